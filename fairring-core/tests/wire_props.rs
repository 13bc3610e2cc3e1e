//! Property tests of frames: the header round trip, refusal of every corrupted
//! field, and validation against a plan.

use fairring_core::DataType;
use fairring_core::plan::{Geometry, Plan, PlanConfig, Slice};
use fairring_core::staging::Event;
use fairring_core::topology::{Location, RankLayout, Topology};
use fairring_core::wire::{
    FrameCheck, FrameHeader, FrameKind, HEADER_LEN, RegionAddress, VERSION, WireError, crc32c,
};
use proptest::prelude::*;

fn kind() -> impl Strategy<Value = FrameKind> {
    prop::sample::select(FrameKind::ALL.to_vec())
}

prop_compose! {
    fn header()(kind in kind(), job_tag in any::<u64>(), sequence in any::<u64>(), slice in any::<u64>(),
                shard in any::<u32>(), source_rank in any::<u32>(), len in any::<u32>(), part in any::<u8>()) -> FrameHeader {
        let max = kind.max_payload();
        let payload_len = if max == 0 { 0 } else if kind.is_data() { 1 + len % max } else { len % (max + 1) };
        // Only a data frame names a part.
        let part = if kind.is_data() { part } else { 0 };
        FrameHeader { kind, job_tag, sequence, slice, shard, source_rank, payload_len, part }
    }
}

/// Recomputes the checksum after a deliberate change, so that the field itself is
/// what decoding must refuse. (The checksum function is pinned by known-answer
/// vectors in the crate's unit tests.)
fn reseal(bytes: &mut [u8; HEADER_LEN]) {
    let crc = crc32c(&bytes[..44]);
    bytes[44..48].copy_from_slice(&crc.to_le_bytes());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    /// A fabric frame's region address survives encoding, and is read from no other
    /// kind of frame.
    #[test]
    fn region_address_round_trip(kind in kind(), job_tag in any::<u64>(), source_rank in any::<u32>(),
                                 region in any::<u32>(), offset in any::<u64>(), immediate in any::<u32>(),
                                 len in any::<u32>()) {
        let address = RegionAddress { region, offset, immediate };
        let payload_len = len % (kind.max_payload() + 1);
        match FrameHeader::for_region(kind, job_tag, source_rank, address, payload_len) {
            Ok(h) => {
                prop_assert!(kind.has_region_address());
                let decoded = FrameHeader::decode(&h.encode()).unwrap();
                prop_assert_eq!(decoded.region_address(), Ok(address));
                prop_assert_eq!((decoded.kind, decoded.job_tag, decoded.source_rank, decoded.payload_len),
                                (kind, job_tag, source_rank, payload_len));
            }
            Err(e) => {
                prop_assert!(!kind.has_region_address());
                prop_assert_eq!(e, WireError::NoRegionAddress { kind });
            }
        }
        let too_long = FrameHeader::for_region(FrameKind::Message, job_tag, source_rank, address,
                                               FrameKind::Message.max_payload() + 1 + len % 1000);
        prop_assert!(matches!(too_long, Err(WireError::PayloadTooLarge { .. })), "oversized message accepted");
    }

    /// A region address with its reserved bits set is refused.
    #[test]
    fn region_address_reserved_bits_refused(region in any::<u32>(), high in 1u32.., offset in any::<u64>()) {
        let mut h = FrameHeader::for_region(FrameKind::Write, 1, 0,
                                            RegionAddress { region, offset, immediate: 0 }, 8).unwrap();
        h.slice |= u64::from(high) << 32;
        let decoded = FrameHeader::decode(&h.encode()).unwrap();
        prop_assert_eq!(decoded.region_address(), Err(WireError::ReservedAddressBits { found: high }));
    }

    #[test]
    fn round_trip(h in header()) {
        let bytes = h.encode();
        prop_assert_eq!(&bytes[..4], b"FRNG");
        prop_assert_eq!(FrameHeader::decode(&bytes), Ok(h));
    }

    /// Any one flipped bit, anywhere, is refused.
    #[test]
    fn any_bit_flip_is_refused(h in header(), bit in 0usize..HEADER_LEN * 8) {
        let mut bytes = h.encode();
        bytes[bit / 8] ^= 1 << (bit % 8);
        prop_assert!(FrameHeader::decode(&bytes).is_err(), "flip of bit {} accepted", bit);
    }

    /// Any one byte replaced by another value is refused.
    #[test]
    fn any_byte_change_is_refused(h in header(), at in 0usize..HEADER_LEN, delta in 1u8..=255) {
        let mut bytes = h.encode();
        bytes[at] = bytes[at].wrapping_add(delta);
        prop_assert!(FrameHeader::decode(&bytes).is_err());
    }

    /// Invalid values with a valid checksum are refused, each with its own error.
    #[test]
    fn every_invalid_field_is_named(h in header(), junk in any::<u32>()) {
        let base = h.encode();

        let mut b = base;
        b[0] ^= 0x20;
        reseal(&mut b);
        prop_assert!(matches!(FrameHeader::decode(&b), Err(WireError::BadMagic { .. })), "corrupted magic accepted");

        let mut b = base;
        b[4] = VERSION.wrapping_add(1 + (junk % 255) as u8);
        reseal(&mut b);
        prop_assert_eq!(FrameHeader::decode(&b), Err(WireError::UnsupportedVersion { found: b[4] }));

        let mut b = base;
        b[5] = [0u8, 9, 10, 200, 255][junk as usize % 5];
        reseal(&mut b);
        prop_assert_eq!(FrameHeader::decode(&b), Err(WireError::UnknownKind { found: b[5] }));

        let mut b = base;
        b[7] = 1 + (junk % 255) as u8;
        reseal(&mut b);
        prop_assert!(matches!(FrameHeader::decode(&b), Err(WireError::ReservedFlags { .. })), "reserved flags accepted");
        if !h.kind.is_data() {
            // Byte 6 is a part only in a data frame.
            let mut b = base;
            b[6] = 1 + (junk % 255) as u8;
            reseal(&mut b);
            prop_assert!(matches!(FrameHeader::decode(&b), Err(WireError::ReservedFlags { .. })), "a part in a control frame accepted");
        }

        let max = h.kind.max_payload();
        let mut b = base;
        let too_long = max + 1 + junk % (u32::MAX - max);
        b[40..44].copy_from_slice(&too_long.to_le_bytes());
        reseal(&mut b);
        prop_assert_eq!(
            FrameHeader::decode(&b),
            Err(WireError::PayloadTooLarge { kind: h.kind, len: too_long, max })
        );

        if h.kind.is_data() {
            let mut b = base;
            b[40..44].copy_from_slice(&0u32.to_le_bytes());
            reseal(&mut b);
            prop_assert_eq!(FrameHeader::decode(&b), Err(WireError::EmptyPayload { kind: h.kind }));
        }
    }

    /// Arbitrary bytes never panic, and whatever decodes re-encodes to the same bytes.
    #[test]
    fn arbitrary_bytes(bytes in prop::array::uniform32(any::<u8>()), tail in prop::array::uniform16(any::<u8>()), magic in any::<bool>()) {
        let mut b = [0u8; HEADER_LEN];
        b[..32].copy_from_slice(&bytes);
        b[32..].copy_from_slice(&tail);
        if magic {
            b[..4].copy_from_slice(b"FRNG");
            b[4] = VERSION;
            reseal(&mut b);
        }
        if let Ok(h) = FrameHeader::decode(&b) {
            prop_assert_eq!(h.encode(), b);
        }
    }
}

const JOB: u64 = 0x5EED_F00D;

/// A frame of version 1 (before dedicated servers served in rail groups), of
/// version 2 (before the trees' default slices), of version 3 (before the wide
/// flat default slices), of version 4 (before a machine's single
/// reduce-scatter of large slices), of version 5 (before the job's NCCL
/// all-reduce on few machines) or of any other version is refused, naming
/// the version, however well sealed.
#[test]
fn frames_of_other_versions_are_refused() {
    assert_eq!(VERSION, 6);
    let good = FrameHeader::control(FrameKind::Hello, JOB, 3, 0).encode();
    assert!(FrameHeader::decode(&good).is_ok());
    for version in [0u8, 1, 2, 3, 4, 5, 7, 255] {
        let mut b = good;
        b[4] = version;
        reseal(&mut b);
        assert_eq!(
            FrameHeader::decode(&b).unwrap_err(),
            WireError::UnsupportedVersion { found: version }
        );
    }
}

prop_compose! {
    fn job()(m in 2u32..=6, d in 1u32..=3, interleaved in any::<bool>(), slice_units in 1u64..=64,
             min_units in 1u64..=8, dtype in prop::sample::select(DataType::ALL.to_vec()),
             slices in 1u64..=4, extra in 0u64..=63, rotation in any::<u64>())
        -> (Geometry, Plan)
    {
        let layout = if interleaved { RankLayout::Interleaved } else { RankLayout::Contiguous };
        let topo = Topology::new(m, d, layout).unwrap();
        let config = PlanConfig::new(slice_units * u64::from(d) * 64, min_units * 64).unwrap();
        let g = Geometry::new(topo, config).unwrap();
        let n = (slices - 1) * (g.full_slice_bytes() / dtype.size_bytes()) + 1 + extra;
        (g, Plan::new(&g, dtype, n, rotation).unwrap())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Every frame the protocol sends is accepted by its receiver and placed inside
    /// the area the layout gives it; every one-field lie is refused.
    #[test]
    fn validation_against_the_plan((g, plan) in job(), seq in any::<u64>()) {
        let topo = g.topology();
        let layout = g.staging_layout();
        for slice in plan.slices() {
            if slice.double_tree().is_some() {
                check_tree_frames(&g, &plan, &slice, seq)?;
                continue;
            }
            for cell in slice.cells() {
                if cell.span().is_empty() {
                    continue;
                }
                let server = cell.server();
                let server_rank = topo.rank(Location { machine: server, device: cell.device() }).unwrap();
                let check = FrameCheck::new(JOB, server_rank, &g).unwrap();
                for client in (0..topo.machines()).filter(|&c| c != server) {
                    let client_rank = topo.rank(Location { machine: client, device: cell.device() }).unwrap();
                    // Contribution: client -> server.
                    let h = FrameHeader::for_cell(FrameKind::Contribution, JOB, seq, &cell, 0, client_rank).unwrap();
                    let p = check.check_data(&h, &plan).unwrap();
                    prop_assert_eq!(p.event, Event::ContributionReceived);
                    prop_assert_eq!(p.from_machine, client);
                    let area = layout.contribution(client, server).unwrap();
                    prop_assert_eq!(p.target.byte_offset(), area.byte_offset());
                    prop_assert!(p.target.byte_len() <= area.byte_len());
                    prop_assert!(p.target.byte_end() <= layout.total_bytes());
                    // Result: server -> client.
                    let r = FrameHeader::for_cell(FrameKind::Result, JOB, seq, &cell, 0, server_rank).unwrap();
                    let client_check = FrameCheck::new(JOB, client_rank, &g).unwrap();
                    let p = client_check.check_data(&r, &plan).unwrap();
                    prop_assert_eq!(p.event, Event::ResultReceived);
                    prop_assert_eq!(p.target.byte_offset(), cell.slot_span().byte_offset());
                    prop_assert_eq!(p.target.byte_len(), cell.span().byte_len());
                    prop_assert!(p.target.byte_end() <= layout.slot().byte_end());

                    // One-field lies.
                    let refused = |h: FrameHeader| check.check_data(&h, &plan).is_err();
                    prop_assert!(refused(FrameHeader { job_tag: JOB ^ 1, ..h }), "wrong job tag accepted");
                    prop_assert!(refused(FrameHeader { slice: plan.slice_count(), ..h }), "slice past the end accepted");
                    prop_assert!(refused(FrameHeader { shard: slice.shards(), ..h }), "shard past the end accepted");
                    prop_assert!(refused(FrameHeader { payload_len: h.payload_len + 1, ..h }), "payload one byte long accepted");
                    prop_assert!(refused(FrameHeader { payload_len: h.payload_len - 1, ..h }), "payload one byte short accepted");
                    prop_assert!(refused(FrameHeader { source_rank: server_rank, ..h }), "frame from the receiver itself accepted");
                    prop_assert!(refused(FrameHeader { source_rank: topo.world_size(), ..h }), "source rank outside the job accepted");
                    prop_assert!(refused(FrameHeader { kind: FrameKind::Credit, ..h }), "credit taken for data");
                    prop_assert!(matches!(check.check_data(&FrameHeader { part: 1, ..h }, &plan), Err(WireError::PartOutOfRange { part: 1, parts: 1 })), "a part of a cell that travels whole accepted");
                    // A frame that claims the receiver as its source, or comes from another rail.
                    prop_assert!(matches!(client_check.check_data(&h, &plan), Err(WireError::FromSelf { .. })), "frame claiming the receiver as sender accepted");
                    if topo.devices_per_machine() > 1 {
                        let other = topo.rank(Location { machine: client, device: (cell.device() + 1) % topo.devices_per_machine() }).unwrap();
                        let off_rail = FrameHeader { source_rank: other, ..h };
                        prop_assert!(matches!(check.check_data(&off_rail, &plan), Err(WireError::WrongRail { .. })), "off-rail frame accepted");
                    }
                    // A contribution to a machine that does not serve the shard, and a
                    // result from one.
                    if let Some(third) = (0..topo.machines()).find(|&x| x != server && x != client) {
                        let liar = topo.rank(Location { machine: third, device: cell.device() }).unwrap();
                        let to_non_server = FrameHeader { source_rank: liar, ..h };
                        let from_non_server = FrameHeader { source_rank: liar, ..r };
                        prop_assert!(matches!(client_check.check_data(&to_non_server, &plan), Err(WireError::NotServer { .. })), "contribution to a non-server accepted");
                        prop_assert!(matches!(client_check.check_data(&from_non_server, &plan), Err(WireError::NotServer { .. })), "result from a non-server accepted");
                    }
                }
            }
        }
    }
}

#[test]
fn control_frames() {
    let topo = Topology::new(2, 2, RankLayout::Contiguous).unwrap();
    let g = Geometry::new(topo, PlanConfig::default()).unwrap();
    let check = FrameCheck::new(JOB, 0, &g).unwrap();
    let credit = FrameHeader {
        kind: FrameKind::Credit,
        job_tag: JOB,
        sequence: 3,
        slice: 0,
        shard: 0,
        source_rank: 2,
        payload_len: 0,
        part: 0,
    };
    assert_eq!(check.check_control(&credit), Ok(()));
    assert_eq!(
        check.check_control(&FrameHeader {
            source_rank: 0,
            ..credit
        }),
        Err(WireError::FromSelf { rank: 0 })
    );
    assert_eq!(
        check.check_control(&FrameHeader {
            job_tag: 1,
            ..credit
        }),
        Err(WireError::WrongJob {
            expected: JOB,
            found: 1
        })
    );
    assert!(matches!(
        check.check_control(&FrameHeader {
            kind: FrameKind::Result,
            ..credit
        }),
        Err(WireError::NotControlFrame { .. })
    ));
    // A plan made under another geometry is refused rather than trusted.
    let other = Geometry::new(topo, PlanConfig::new(1 << 20, 1 << 16).unwrap()).unwrap();
    let plan = Plan::new(&other, DataType::F32, 1000, 0).unwrap();
    let cell = plan.slice(0).unwrap().cell(0, 0).unwrap();
    let h = FrameHeader::for_cell(FrameKind::Contribution, JOB, 0, &cell, 0, 2).unwrap();
    assert_eq!(
        check.check_data(&h, &plan),
        Err(WireError::GeometryMismatch)
    );
}

/// Through trees: every part of every child's contribution lands at its place
/// in the area by child, every part of the parent's result over its place in
/// the cell (the parent's result of an inner node's own shard as such), parts
/// tile the cell, and a frame from any other machine, or for a part past the
/// cell's, is refused.
fn check_tree_frames(
    g: &Geometry,
    plan: &Plan,
    slice: &Slice,
    seq: u64,
) -> Result<(), TestCaseError> {
    let topo = g.topology();
    let layout = g.staging_layout();
    let trees = slice.double_tree().unwrap();
    for cell in slice.cells().filter(|c| !c.span().is_empty()) {
        let tree = slice.tree_of(cell.shard()).unwrap().unwrap();
        let rank = |machine| {
            topo.rank(Location {
                machine,
                device: cell.device(),
            })
            .unwrap()
        };
        prop_assert_eq!(cell.parts(), slice.parts());
        let mut next = cell.span().byte_offset();
        for part in 0..cell.parts() {
            let span = cell.part(part).unwrap();
            prop_assert_eq!(span.byte_offset(), next, "parts tile the cell");
            prop_assert!(
                !span.is_empty(),
                "part {} of {} is empty",
                part,
                cell.parts()
            );
            next = span.byte_end();
        }
        prop_assert_eq!(next, cell.span().byte_end());
        let past = FrameHeader::for_cell(FrameKind::Contribution, JOB, seq, &cell, cell.parts(), 0);
        prop_assert!(
            matches!(past, Err(WireError::PartOutOfRange { .. })),
            "a part past the cell's named"
        );
        for (me, part) in
            (0..topo.machines()).flat_map(|me| (0..cell.parts()).map(move |p| (me, p)))
        {
            let span = cell.part(part).unwrap();
            let within = span.byte_offset() - cell.span().byte_offset();
            let check = FrameCheck::new(JOB, rank(me), g).unwrap();
            let children = trees.children(tree, me).unwrap();
            let parent = trees.parent(tree, me).unwrap();
            for from in (0..topo.machines()).filter(|&x| x != me) {
                let up = FrameHeader::for_cell(
                    FrameKind::Contribution,
                    JOB,
                    seq,
                    &cell,
                    part,
                    rank(from),
                )
                .unwrap();
                prop_assert_eq!(u64::from(up.payload_len), span.byte_len());
                match children.iter().position(|&c| c == Some(from)) {
                    Some(i) => {
                        let p = check.check_data(&up, plan).unwrap();
                        prop_assert_eq!(p.event, Event::ContributionReceived);
                        prop_assert_eq!(p.part, part);
                        let area = layout.child(u32::try_from(i).unwrap()).unwrap();
                        prop_assert_eq!(p.target.byte_offset(), area.byte_offset() + within);
                        prop_assert!(p.target.byte_end() <= area.byte_end());
                        prop_assert!(p.target.byte_end() <= layout.total_bytes());
                        if cell.parts() > 1 {
                            // A part's length with the other part's number.
                            let other = FrameHeader {
                                part: u8::from(part == 0),
                                ..up
                            };
                            let lie = check.check_data(&other, plan);
                            if cell.part(1 - part).unwrap().byte_len() != span.byte_len() {
                                prop_assert!(
                                    matches!(lie, Err(WireError::LengthMismatch { .. })),
                                    "a part with another's length accepted"
                                );
                            } else {
                                prop_assert_eq!(
                                    lie.unwrap().target.byte_offset(),
                                    area.byte_offset() + cell.part(1 - part).unwrap().byte_offset()
                                        - cell.span().byte_offset()
                                );
                            }
                        }
                    }
                    None => prop_assert!(
                        matches!(
                            check.check_data(&up, plan),
                            Err(WireError::NotTreeNeighbour { .. })
                        ),
                        "contribution from a non-child accepted"
                    ),
                }
                let down =
                    FrameHeader::for_cell(FrameKind::Result, JOB, seq, &cell, part, rank(from))
                        .unwrap();
                if parent == Some(from) {
                    let p = check.check_data(&down, plan).unwrap();
                    let inner = trees.is_inner(tree, me).unwrap();
                    prop_assert_eq!(
                        p.event,
                        if inner {
                            Event::ParentResultReceived
                        } else {
                            Event::ResultReceived
                        }
                    );
                    prop_assert_eq!(p.part, part);
                    prop_assert_eq!(
                        p.target.byte_offset(),
                        cell.slot_span().byte_offset() + within
                    );
                    prop_assert_eq!(p.target.byte_len(), span.byte_len());
                    prop_assert!(p.target.byte_end() <= layout.slot().byte_end());
                } else {
                    prop_assert!(
                        matches!(
                            check.check_data(&down, plan),
                            Err(WireError::NotTreeNeighbour { .. })
                        ),
                        "result from a non-parent accepted"
                    );
                }
            }
        }
    }
    Ok(())
}
