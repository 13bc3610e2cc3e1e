//! The tcp admission handshake.
//!
//! - Tampering: a dialer and an acceptor talk through a channel that alters bytes
//!   of their messages as the input says. Untouched, both must admit; with any
//!   byte altered, they must never both admit.
//! - Garbage: arbitrary bytes from a stranger, in arbitrary pieces, must never be
//!   admitted by the acceptor, and never make it or its frame reader panic.
#![no_main]

use arbitrary::Arbitrary;
use fairring_core::wire::FrameHeader;
use fairring_rdma::JobSecret;
use fairring_rdma::tcp::protocol::{
    Acceptor, AcceptorStep, Dialer, DialerStep, HandshakeParams, HelloReader, welcome_frame,
};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Alteration {
    message: u8,
    position: u8,
    xor: u8,
}

#[derive(Arbitrary, Debug)]
enum Input {
    Tamper {
        alterations: Vec<Alteration>,
        dialer_nonce: [u8; 32],
        acceptor_nonce: [u8; 32],
    },
    Garbage {
        bytes: Vec<u8>,
        pieces: Vec<u8>,
    },
}

fn params(rank: u32) -> HandshakeParams {
    HandshakeParams {
        job_tag: 5,
        epoch: 2,
        world_size: 4,
        rank,
        secret: JobSecret::from_bytes([7; 32]),
    }
}

/// Delivers `bytes` to a fresh frame reader; returns the frame if exactly one
/// complete frame parses (an altered length may leave it incomplete).
fn deliver(bytes: &[u8]) -> Option<(FrameHeader, Vec<u8>)> {
    let mut reader = HelloReader::new();
    let mut at = 0;
    while at < bytes.len() {
        let buffer = reader.buffer();
        let n = buffer.len().min(bytes.len() - at);
        buffer[..n].copy_from_slice(&bytes[at..at + n]);
        at += n;
        match reader.filled(n) {
            Ok(Some((header, payload))) => return Some((header, payload.to_vec())),
            Ok(None) => {}
            Err(_) => return None,
        }
    }
    None
}

/// Applies the alterations meant for `message`; returns whether the bytes changed
/// (two alterations of one byte may cancel out).
fn alter(bytes: &mut [u8], message: u8, alterations: &[Alteration]) -> bool {
    let original = bytes.to_vec();
    for a in alterations.iter().filter(|a| a.message % 4 == message) {
        if let Some(b) = bytes.get_mut(usize::from(a.position)) {
            *b ^= a.xor;
        }
    }
    bytes != original.as_slice()
}

fuzz_target!(|input: Input| match input {
    Input::Tamper {
        alterations,
        dialer_nonce,
        acceptor_nonce,
    } => {
        let (dialer_params, acceptor_params) = (params(3), params(1));
        let (mut dialer, hello) = Dialer::start(&dialer_params, 1, dialer_nonce);
        let mut acceptor = Acceptor::new();
        let mut altered = false;

        let mut m1 = hello.as_bytes().to_vec();
        altered |= alter(&mut m1, 0, &alterations);
        let Some((h, p)) = deliver(&m1) else {
            return assert!(altered);
        };
        let Ok(AcceptorStep::Reply(challenge)) =
            acceptor.on_frame(&acceptor_params, &h, &p, |_| false, acceptor_nonce)
        else {
            return assert!(altered, "an untouched hello was refused");
        };

        let mut m2 = challenge.as_bytes().to_vec();
        altered |= alter(&mut m2, 1, &alterations);
        let Some((h, p)) = deliver(&m2) else {
            return assert!(altered);
        };
        let Ok(DialerStep::Reply(proof)) = dialer.on_frame(&dialer_params, &h, &p) else {
            return assert!(altered, "an untouched challenge was refused");
        };

        let mut m3 = proof.as_bytes().to_vec();
        altered |= alter(&mut m3, 2, &alterations);
        let Some((h, p)) = deliver(&m3) else {
            return assert!(altered);
        };
        let acceptor_admits = matches!(
            acceptor.on_frame(&acceptor_params, &h, &p, |_| false, acceptor_nonce),
            Ok(AcceptorStep::Admit { peer: 3 })
        );
        if !acceptor_admits {
            return assert!(altered, "an untouched proof was refused");
        }

        let mut m4 = welcome_frame(&acceptor_params).as_bytes().to_vec();
        let welcome_altered = alter(&mut m4, 3, &alterations);
        let dialer_admits = deliver(&m4).is_some_and(|(h, p)| {
            matches!(
                dialer.on_frame(&dialer_params, &h, &p),
                Ok(DialerStep::Admitted)
            )
        });
        if altered || welcome_altered {
            assert!(!dialer_admits, "both admitted over an altered exchange");
        } else {
            assert!(dialer_admits, "an untouched welcome was refused");
        }
    }
    Input::Garbage { bytes, pieces } => {
        let acceptor_params = params(1);
        let mut acceptor = Acceptor::new();
        let mut reader = HelloReader::new();
        let mut at = 0;
        let mut piece = 0;
        while at < bytes.len() {
            let size = pieces
                .get(piece % pieces.len().max(1))
                .map_or(usize::MAX, |&p| usize::from(p).max(1));
            piece += 1;
            let buffer = reader.buffer();
            let n = buffer.len().min(size).min(bytes.len() - at);
            buffer[..n].copy_from_slice(&bytes[at..at + n]);
            at += n;
            match reader.filled(n) {
                Ok(Some((h, p))) => {
                    match acceptor.on_frame(&acceptor_params, &h, p, |_| false, [0; 32]) {
                        Ok(AcceptorStep::Admit { .. }) => panic!("a stranger was admitted"),
                        Ok(AcceptorStep::Reply(_)) => {}
                        Err(_) => return,
                    }
                }
                Ok(None) => {}
                Err(_) => return,
            }
        }
    }
});
