//! Frames: decoding arbitrary header bytes either refuses or yields a header that
//! re-encodes to the same bytes; and validation of a frame against a real plan,
//! starting from a frame the protocol would really send and changing its fields
//! arbitrarily, either refuses or places the payload inside the staging buffer, in
//! the area of its kind, at its part's place, with exactly that part's length.
#![no_main]

use arbitrary::Arbitrary;
use fairring_core::staging::Event;
use fairring_core::topology::Location;
use fairring_core::wire::{FrameCheck, FrameHeader, FrameKind, HEADER_LEN, crc32c};
use fairring_fuzz::Job;
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Lie {
    kind: u8,
    job_tag: u64,
    slice: u64,
    shard: u32,
    source_rank: u32,
    payload_len: u32,
    part: u8,
}

#[derive(Arbitrary, Debug)]
enum Input {
    /// Raw header bytes; optionally re-sealed so that the field checks are reached.
    Bytes {
        header: [u8; HEADER_LEN],
        reseal: bool,
    },
    /// A real frame of a real plan (picked by the indices), its fields then XORed
    /// with the lie (all zero: the honest frame).
    Frame {
        job: Job,
        slice: u64,
        device: u32,
        shard: u32,
        machine: u32,
        result: bool,
        part: u32,
        lie: Lie,
    },
}

fuzz_target!(|input: Input| match input {
    Input::Bytes { mut header, reseal } => {
        if reseal {
            let crc = crc32c(&header[..44]);
            header[44..].copy_from_slice(&crc.to_le_bytes());
        }
        if let Ok(decoded) = FrameHeader::decode(&header) {
            assert_eq!(
                decoded.encode(),
                header,
                "decode is not the inverse of encode"
            );
            assert!(decoded.payload_len <= decoded.kind.max_payload());
        }
    }
    Input::Frame {
        job,
        slice,
        device,
        shard,
        machine,
        result,
        part,
        lie,
    } => {
        let Some((geometry, plan)) = job.build() else {
            return;
        };
        if plan.slice_count() == 0 {
            return;
        }
        let topology = geometry.topology();
        let slice = plan.slice(slice % plan.slice_count()).unwrap();
        let cell = slice
            .cell(
                device % topology.devices_per_machine(),
                shard % slice.shards(),
            )
            .unwrap();
        let other = machine % topology.machines();
        let rank = |m| {
            topology
                .rank(Location {
                    machine: m,
                    device: cell.device(),
                })
                .unwrap()
        };
        // Contribution: `other` -> server. Result: server -> `other`. Through
        // trees, the server is `other`'s parent in the cell's tree.
        let tree = slice.tree_of(cell.shard()).unwrap();
        let above = match (slice.double_tree(), tree) {
            (Some(trees), Some(t)) => match trees.parent(t, other).unwrap() {
                Some(parent) => parent,
                None => return,
            },
            _ => cell.server(),
        };
        let (kind, from, to) = if result {
            (FrameKind::Result, above, other)
        } else {
            (FrameKind::Contribution, other, above)
        };
        let part = part % cell.parts();
        let Ok(honest) = FrameHeader::for_cell(kind, 7, 1, &cell, part, rank(from)) else {
            return;
        };
        let header = FrameHeader {
            kind: FrameKind::from_u8(honest.kind as u8 ^ (lie.kind % 8)).unwrap_or(honest.kind),
            job_tag: honest.job_tag ^ lie.job_tag,
            sequence: honest.sequence,
            slice: honest.slice ^ lie.slice,
            shard: honest.shard ^ lie.shard,
            source_rank: honest.source_rank ^ lie.source_rank,
            payload_len: honest.payload_len ^ lie.payload_len,
            part: honest.part ^ lie.part,
        };
        let Ok(header) = FrameHeader::decode(&header.encode()) else {
            return;
        };
        let receiver = rank(to);
        let check = FrameCheck::new(7, receiver, &geometry).unwrap();
        let control = check.check_control(&header);
        let Ok(placement) = check.check_data(&header, &plan) else {
            // The honest frame between two machines is always accepted.
            let honest_frame = header == honest && from != to && !cell.span().is_empty();
            assert!(!honest_frame, "honest frame refused: {honest:?}");
            return;
        };
        assert!(control.is_err(), "a frame passed as both control and data");
        let layout = geometry.staging_layout();
        let len = u64::from(header.payload_len);
        assert_eq!(placement.target.byte_len(), len);
        let part_span = placement.cell.part(placement.part).unwrap();
        assert_eq!(part_span.byte_len(), len);
        assert_eq!(placement.part, u32::from(header.part));
        // Where the part lies within its cell, wherever the cell lands.
        let within = part_span.byte_offset() - placement.cell.span().byte_offset();
        assert!(placement.target.byte_end() <= layout.total_bytes());
        assert_eq!(header.job_tag, 7);
        assert_ne!(header.source_rank, receiver);
        let me = topology.locate(receiver).unwrap();
        let sender = topology.locate(header.source_rank).unwrap();
        assert_eq!(sender.device, me.device, "accepted from another rail");
        assert_ne!(
            sender.machine, me.machine,
            "accepted from the receiver's own machine"
        );
        if let (Some(trees), Some(_)) = (slice.double_tree(), tree) {
            let cell_tree = plan
                .slice(placement.cell.slice())
                .unwrap()
                .tree_of(placement.cell.shard())
                .unwrap()
                .unwrap();
            match placement.event {
                Event::ContributionReceived => {
                    let children = trees.children(cell_tree, me.machine).unwrap();
                    let child = children
                        .iter()
                        .position(|&c| c == Some(sender.machine))
                        .expect("contribution from a non-child");
                    let area = layout.child(u32::try_from(child).unwrap()).unwrap();
                    assert_eq!(placement.target.byte_offset(), area.byte_offset() + within);
                    assert!(placement.target.byte_end() <= area.byte_end());
                }
                Event::ResultReceived | Event::ParentResultReceived => {
                    assert_eq!(
                        trees.parent(cell_tree, me.machine).unwrap(),
                        Some(sender.machine),
                        "result from a non-parent"
                    );
                    assert_eq!(
                        placement.event == Event::ParentResultReceived,
                        trees.is_inner(cell_tree, me.machine).unwrap()
                    );
                    assert_eq!(
                        placement.target.byte_offset(),
                        placement.cell.slot_span().byte_offset() + within
                    );
                }
                other => panic!("a frame mapped to {other:?}"),
            }
            return;
        }
        match placement.event {
            Event::ContributionReceived => {
                assert_eq!(
                    placement.cell.server(),
                    me.machine,
                    "contribution to a non-server"
                );
                let area = layout.contribution(sender.machine, me.machine).unwrap();
                assert_eq!(placement.target.byte_offset(), area.byte_offset());
                assert!(len <= area.byte_len());
            }
            Event::ResultReceived => {
                assert_eq!(
                    placement.cell.server(),
                    sender.machine,
                    "result from a non-server"
                );
                assert!(placement.target.byte_end() <= layout.slot().byte_end());
                assert_eq!(
                    placement.target.byte_offset(),
                    placement.cell.slot_span().byte_offset()
                );
            }
            other => panic!("a frame mapped to {other:?}"),
        }
    }
});
