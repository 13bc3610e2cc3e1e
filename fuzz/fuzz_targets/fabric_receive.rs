//! The receive path of an admitted tcp connection, fed arbitrary bytes in arbitrary
//! pieces: well-formed frames (so payloads are reached), frames with lying fields,
//! and raw garbage. It must never panic, never write outside a region (ASan), and
//! report only writes that fit their region; after an error it stops.
#![no_main]

use std::ptr::NonNull;
use std::sync::Arc;

use arbitrary::Arbitrary;
use fairring_core::wire::{FrameHeader, FrameKind, RegionAddress};
use fairring_rdma::fabric::LocalRegion;
use fairring_rdma::tcp::protocol::{Received, Receiver, RegionTable};
use libfuzzer_sys::fuzz_target;

const PEER: u32 = 3;
const JOB: u64 = 77;

#[derive(Arbitrary, Debug)]
enum Chunk {
    /// A frame built from these fields, its payload `fill` repeated.
    Frame {
        kind: u8,
        region: u8,
        offset: u16,
        len: u16,
        immediate: u32,
        source: bool,
        fill: u8,
    },
    /// Bytes as they are.
    Raw(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
struct Input {
    chunks: Vec<Chunk>,
    /// Sizes of the pieces the socket hands over, cycled.
    pieces: Vec<u16>,
}

fuzz_target!(|input: Input| {
    let table = Arc::new(RegionTable::new());
    let mut memory = [vec![0xaa; 4096], vec![0xaa; 64]];
    let regions: Vec<_> = memory
        .iter_mut()
        // SAFETY: the vectors outlive the regions (dropped at the end of this
        // closure, regions first) and are not touched while registered.
        .map(|m| unsafe { table.register(NonNull::new(m.as_mut_ptr()).unwrap(), m.len()) }.unwrap())
        .collect();
    let keys: Vec<u32> = regions.iter().map(|r| r.key().0).collect();

    let mut stream = Vec::new();
    for chunk in &input.chunks {
        match chunk {
            Chunk::Frame {
                kind,
                region,
                offset,
                len,
                immediate,
                source,
                fill,
            } => {
                let kind = FrameKind::from_u8(kind % 9).unwrap_or(FrameKind::Write);
                let region = keys.get(usize::from(*region % 3)).copied().unwrap_or(999);
                let address = RegionAddress {
                    region,
                    offset: u64::from(*offset),
                    immediate: *immediate,
                };
                let len = u32::from(*len) % 8192;
                let header = FrameHeader::for_region(
                    kind,
                    JOB,
                    if *source { PEER } else { PEER + 1 },
                    address,
                    len,
                )
                .unwrap_or(FrameHeader::control(
                    kind,
                    JOB,
                    PEER,
                    len.min(kind.max_payload()),
                ));
                stream.extend_from_slice(&header.encode());
                stream.extend(std::iter::repeat_n(*fill, header.payload_len as usize));
            }
            Chunk::Raw(bytes) => stream.extend_from_slice(bytes),
        }
    }

    let mut receiver = Receiver::new(PEER, JOB);
    let mut at = 0;
    let mut piece = 0;
    while at < stream.len() {
        let size = input
            .pieces
            .get(piece % input.pieces.len().max(1))
            .map_or(1 << 20, |&p| usize::from(p).max(1));
        piece += 1;
        let buffer = receiver.buffer();
        assert!(!buffer.is_empty(), "the receiver asked for nothing");
        let n = buffer.len().min(size).min(stream.len() - at);
        buffer[..n].copy_from_slice(&stream[at..at + n]);
        at += n;
        match receiver.filled(n, &table) {
            Ok(Received::Landed {
                region,
                offset,
                len,
                ..
            }) => {
                let index = keys
                    .iter()
                    .position(|&k| k == region.0)
                    .expect("landed in a registered region");
                assert!(
                    offset + len <= memory[index].len() as u64,
                    "landed outside its region"
                );
            }
            Ok(_) => {}
            Err(_) => break,
        }
    }
    drop(regions);
});
