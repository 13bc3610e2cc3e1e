//! A queue pair's endpoint, authenticated with the job secret.
//!
//! ```text
//! offset size
//!  0      4   queue pair number
//!  4      4   first packet sequence number (24 bits)
//!  8      2   LID
//! 10      1   active MTU (ibv_mtu)
//! 11      2   receive work requests posted (the peer's initial credits)
//! 13     16   GID
//! 29     32   HMAC-SHA256 of bytes 0..29, bound to the protocol version
//!             (fairring-core's `wire::VERSION`), job, epoch, world size and
//!             both ranks (from, to)
//! ```
//!
//! An endpoint travels through the rendezvous store; the MAC means one forged or
//! taken from another job, epoch or pair of ranks, or published by a process of
//! another protocol version, is refused, before a queue pair is connected to it
//! and so before any region is reachable from it.

use hmac::{KeyInit, Mac};
use sha2::Sha256;

use super::device::RemoteQueuePair;
use crate::fabric::{Endpoint, Refusal};
use crate::secret::JobSecret;

const BODY: usize = 29;

/// What an endpoint is bound to.
pub(crate) struct Binding<'a> {
    /// The protocol version (`fairring_core::wire::VERSION`).
    pub(crate) version: u8,
    pub(crate) secret: &'a JobSecret,
    pub(crate) job_tag: u64,
    pub(crate) epoch: u64,
    pub(crate) world_size: u32,
}

fn mac(binding: &Binding<'_>, from: u32, to: u32, body: &[u8]) -> hmac::Hmac<Sha256> {
    let mut mac = <hmac::Hmac<Sha256> as KeyInit>::new_from_slice(binding.secret.as_bytes())
        .expect("HMAC takes a key of any length");
    mac.update(b"fairring verbs endpoint, protocol version");
    mac.update(&[binding.version]);
    mac.update(&binding.job_tag.to_le_bytes());
    mac.update(&binding.epoch.to_le_bytes());
    mac.update(&binding.world_size.to_le_bytes());
    mac.update(&from.to_le_bytes());
    mac.update(&to.to_le_bytes());
    mac.update(body);
    mac
}

/// Encodes the endpoint `from` publishes for `to`.
pub(crate) fn encode(
    binding: &Binding<'_>,
    from: u32,
    to: u32,
    qp: &RemoteQueuePair,
    credits: u16,
) -> Endpoint {
    let mut bytes = [0u8; BODY + 32];
    bytes[0..4].copy_from_slice(&qp.qp_num.to_le_bytes());
    bytes[4..8].copy_from_slice(&qp.psn.to_le_bytes());
    bytes[8..10].copy_from_slice(&qp.lid.to_le_bytes());
    bytes[10] = u8::try_from(qp.mtu).unwrap_or(u8::MAX);
    bytes[11..13].copy_from_slice(&credits.to_le_bytes());
    bytes[13..29].copy_from_slice(&qp.gid);
    let tag = mac(binding, from, to, &bytes[..BODY])
        .finalize()
        .into_bytes();
    bytes[BODY..].copy_from_slice(&tag);
    Endpoint::from_bytes(&bytes).expect("61 bytes fit an endpoint")
}

/// Decodes the endpoint `from` published for `to`, refusing it unless its MAC
/// verifies (in constant time).
pub(crate) fn decode(
    binding: &Binding<'_>,
    from: u32,
    to: u32,
    endpoint: &Endpoint,
) -> Result<(RemoteQueuePair, u16), Refusal> {
    let bytes = endpoint.as_bytes();
    if bytes.len() != BODY + 32 {
        return Err(Refusal::Malformed);
    }
    mac(binding, from, to, &bytes[..BODY])
        .verify_slice(&bytes[BODY..])
        .map_err(|_| Refusal::WrongSecret)?;
    let u32_at =
        |at: usize| u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
    let mut gid = [0; 16];
    gid.copy_from_slice(&bytes[13..29]);
    Ok((
        RemoteQueuePair {
            qp_num: u32_at(0),
            psn: u32_at(4) & 0xff_ffff,
            lid: u16::from_le_bytes([bytes[8], bytes[9]]),
            mtu: u32::from(bytes[10]),
            gid,
        },
        u16::from_le_bytes([bytes[11], bytes[12]]),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_bound_to_job_epoch_and_ranks() {
        let secret = JobSecret::from_bytes([3; 32]);
        let binding = Binding {
            version: fairring_core::wire::VERSION,
            secret: &secret,
            job_tag: 1,
            epoch: 2,
            world_size: 4,
        };
        let qp = RemoteQueuePair {
            qp_num: 77,
            psn: 0x12_3456,
            lid: 9,
            mtu: 3,
            gid: [5; 16],
        };
        let endpoint = encode(&binding, 1, 2, &qp, 256);
        assert_eq!(decode(&binding, 1, 2, &endpoint), Ok((qp, 256)));
        // Another pair of ranks, direction, epoch, job or secret: refused.
        assert_eq!(decode(&binding, 2, 1, &endpoint), Err(Refusal::WrongSecret));
        assert_eq!(decode(&binding, 1, 3, &endpoint), Err(Refusal::WrongSecret));
        let stale = Binding {
            epoch: 1,
            ..binding
        };
        assert_eq!(decode(&stale, 1, 2, &endpoint), Err(Refusal::WrongSecret));
        // A process of another protocol version: refused.
        let older = Binding {
            version: fairring_core::wire::VERSION - 1,
            ..binding
        };
        assert_eq!(decode(&older, 1, 2, &endpoint), Err(Refusal::WrongSecret));
        let other_secret = JobSecret::from_bytes([4; 32]);
        let other = Binding {
            secret: &other_secret,
            ..binding
        };
        assert_eq!(decode(&other, 1, 2, &endpoint), Err(Refusal::WrongSecret));
        // Any altered byte: refused.
        for i in 0..endpoint.as_bytes().len() {
            let mut bytes = endpoint.as_bytes().to_vec();
            bytes[i] ^= 1;
            let altered = Endpoint::from_bytes(&bytes).unwrap();
            assert!(decode(&binding, 1, 2, &altered).is_err(), "byte {i}");
        }
        assert_eq!(
            decode(&binding, 1, 2, &Endpoint::from_bytes(&[0; 7]).unwrap()),
            Err(Refusal::Malformed)
        );
    }
}
