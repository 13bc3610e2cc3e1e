//! Reading another local rank's memory in one copy: Linux's cross-memory
//! attach (`process_vm_readv`), which copies from another process's address
//! space inside the kernel.
//!
//! The shared-memory step stages what its ranks exchange through the
//! machine's segment: one copy in, one copy out. A broadcast's bytes need no
//! reduction, so on one machine every other rank reads them from the root's
//! tensor straight into its own ([`ShmStep`](super::ShmStep)): half the
//! copies. A point-to-point message between two ranks of one machine is
//! copied the same way, by its receiver (`engine::messages`).
//!
//! Only reads: no rank ever writes into another process's memory. A read
//! that races with the owner's failure can be thrown away (its reader fails
//! the operation, see [`tensor_copies`](super::tensor_copies)); a write into
//! memory the owner's caller has taken back could not be undone, and a
//! writer stopped in the middle of one would keep its owner from ever
//! letting go.
//!
//! Copying to and from another process needs the kernel's leave: the same
//! user, and where Yama's `ptrace_scope` restricts tracing, more. The
//! machine's ranks find out when the communicator is made: each publishes
//! its process id and the address of a word whose value it knows, each reads
//! every other's, and they take this path only if every rank could read
//! every other ([`PeerCopy::agree`]); otherwise every rank stages as before.

use std::time::Duration;

use crate::error::{Error, Result};
use crate::store::{Store, gather};

/// What each rank's probe word holds: its readers check they read this.
const PROBE_VALUE: u64 = 0x6672_2d70_6565_7221;

/// The word a peer reads to find out whether it may read this process.
static PROBE: u64 = PROBE_VALUE;

/// The processes of the machine's ranks, by local rank, each open to every
/// other's reads.
#[derive(Debug)]
pub(crate) struct PeerCopy {
    /// By local rank: the process, and the rank in the job.
    pids: Box<[i32]>,
    ranks: Box<[u32]>,
}

impl PeerCopy {
    /// Every local rank in this process (the engine's simulation): reading a
    /// peer reads this process's own memory, through the same call.
    #[cfg(test)]
    pub(crate) fn within_this_process(ranks: &[u32]) -> PeerCopy {
        PeerCopy {
            pids: vec![std::process::id().cast_signed(); ranks.len()].into(),
            ranks: ranks.into(),
        }
    }

    /// Agrees with the machine's other ranks (global ranks `ranks`, by local
    /// rank; this one is local rank `me`) whether each may read every
    /// other's memory: `Some` where every one may, `None` where one may not
    /// (or the system has no such call), on every rank alike.
    pub(crate) fn agree(
        store: &dyn Store,
        ranks: &[u32],
        me: u32,
        timeout: Duration,
    ) -> Result<Option<PeerCopy>> {
        let key = |what: &str, r: u32| format!("peer-copy/{what}/{r}");
        let mine = ranks[me as usize];
        let pid = std::process::id();
        let probe = &raw const PROBE as u64;
        store.set(&key("where", mine), format!("{pid} {probe:#x}").as_bytes())?;
        let keys: Vec<String> = ranks.iter().map(|&r| key("where", r)).collect();
        let places = gather(store, &keys, timeout)?;
        let mut pids = Vec::with_capacity(ranks.len());
        let mut verdict = Ok(());
        for (local, place) in places.iter().enumerate() {
            let (pid, probe) = parse_place(place)
                .ok_or_else(|| Error::store("get", format!("{} holds no process", keys[local])))?;
            pids.push(pid);
            if local != me as usize && verdict.is_ok() {
                let mut word = [0u8; 8];
                let local = Local {
                    at: word.as_mut_ptr(),
                    len: word.len(),
                };
                verdict = read(pid, probe, local).and_then(|()| {
                    if u64::from_ne_bytes(word) == PROBE_VALUE {
                        Ok(())
                    } else {
                        Err(format!(
                            "read {:#x}, not the probe",
                            u64::from_ne_bytes(word)
                        ))
                    }
                });
            }
        }
        let said = match &verdict {
            Ok(()) => "ok".to_owned(),
            Err(why) => format!("no: {why}"),
        };
        store.set(&key("verdict", mine), said.as_bytes())?;
        let keys: Vec<String> = ranks.iter().map(|&r| key("verdict", r)).collect();
        let verdicts = gather(store, &keys, timeout)?;
        let refused = verdicts
            .iter()
            .zip(ranks)
            .find(|(v, _)| v.as_slice() != b"ok");
        if let Some((why, rank)) = refused {
            log::debug!(
                "fairring: rank {rank} cannot read its machine's other ranks ({}): broadcasts \
                 on the machine stage through shared memory",
                String::from_utf8_lossy(why)
            );
            return Ok(None);
        }
        Ok(Some(PeerCopy {
            pids: pids.into(),
            ranks: ranks.into(),
        }))
    }

    /// Copies `into.len()` bytes at address `at` of local rank `rank`'s
    /// process into `into`.
    pub(crate) fn read(&self, rank: u32, at: u64, into: &mut [u8]) -> Result<()> {
        let (pid, peer) = self.process(rank)?;
        let local = Local {
            at: into.as_mut_ptr(),
            len: into.len(),
        };
        read(pid, at, local).map_err(|why| {
            Error::peer(
                peer,
                format!("reading {} bytes of its tensor: {why}", into.len()),
            )
        })
    }

    /// Whether the machine's ranks may read each other under the
    /// tensor-copy words' handshake: one bit per reader.
    pub(crate) fn fits_the_copy_words(&self) -> bool {
        u32::try_from(self.pids.len()).is_ok_and(|n| n <= super::tensor_copies::MAX_READERS)
    }

    /// The rank in the job of local rank `rank`.
    pub(crate) fn rank_of(&self, rank: u32) -> u32 {
        self.ranks.get(rank as usize).copied().unwrap_or(rank)
    }

    /// Local rank `rank`'s process, and its rank in the job.
    fn process(&self, rank: u32) -> Result<(i32, u32)> {
        let at = rank as usize;
        match (self.pids.get(at), self.ranks.get(at)) {
            (Some(&pid), Some(&peer)) => Ok((pid, peer)),
            _ => Err(Error::internal(
                "a local rank has a process",
                format!("local rank {rank}"),
            )),
        }
    }
}

/// This process's side of a copy: `len` bytes at `at`.
#[derive(Clone, Copy)]
struct Local {
    at: *mut u8,
    len: usize,
}

/// `"<pid> <address>"`, as [`PeerCopy::agree`] publishes it.
fn parse_place(place: &[u8]) -> Option<(i32, u64)> {
    let text = std::str::from_utf8(place).ok()?;
    let (pid, at) = text.split_once(' ')?;
    let at = u64::from_str_radix(at.strip_prefix("0x")?, 16).ok()?;
    Some((pid.parse().ok()?, at))
}

/// Copies `local.len` bytes at address `at` of process `pid` into `local`, in
/// as many calls as the kernel takes.
#[cfg(target_os = "linux")]
fn read(pid: i32, at: u64, local: Local) -> std::result::Result<(), String> {
    let mut done = 0usize;
    while done < local.len {
        let here = libc::iovec {
            iov_base: local.at.wrapping_add(done).cast(),
            iov_len: local.len - done,
        };
        let there = libc::iovec {
            iov_base: (at + done as u64) as *mut libc::c_void,
            iov_len: local.len - done,
        };
        // SAFETY: `here` lies in `local`, which the caller may write;
        // `there` is another process's memory, which the kernel checks (a bad
        // address is an error, never an access of ours).
        let moved = unsafe { libc::process_vm_readv(pid, &here, 1, &there, 1, 0) };
        match moved {
            n if n > 0 => done += n.cast_unsigned(),
            0 => return Err(format!("process {pid} moved no bytes at {at:#x}")),
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(format!("process_vm_readv of process {pid}: {e}"));
                }
            }
        }
    }
    Ok(())
}

/// No cross-memory attach: every rank stages.
#[cfg(not(target_os = "linux"))]
fn read(_: i32, _: u64, _: Local) -> std::result::Result<(), String> {
    Err("this system has no process_vm_readv".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::in_process::InProcessStore;

    #[test]
    fn reads_copy_and_a_bad_address_is_an_error() {
        let peers = PeerCopy::within_this_process(&[6, 7]);
        let source: Vec<u8> = (0..=255).cycle().take(3 << 20).collect();
        let mut copy = vec![0u8; source.len()];
        peers.read(1, source.as_ptr() as u64, &mut copy).unwrap();
        assert!(copy == source, "the read differs from its source");
        let e = peers.read(1, 8, &mut [0u8; 16]).unwrap_err().to_string();
        assert!(e.contains("rank 7"), "{e}");
        let e = peers.read(0, 8, &mut [0u8; 16]).unwrap_err().to_string();
        assert!(
            e.contains("rank 6") && e.contains("reading 16 bytes"),
            "{e}"
        );
        assert!(
            peers
                .read(2, source.as_ptr() as u64, &mut [0u8; 1])
                .is_err()
        );
    }

    /// Two local ranks (threads here) agreeing over `board`.
    fn agree_on(board: InProcessStore) -> Vec<bool> {
        let board = std::sync::Arc::new(board);
        let ranks = [4u32, 5];
        let agreed: Vec<_> = (0..2)
            .map(|me| {
                let board = std::sync::Arc::clone(&board);
                std::thread::spawn(move || {
                    PeerCopy::agree(&*board, &ranks, me, Duration::from_secs(10))
                        .unwrap()
                        .is_some()
                })
            })
            .collect();
        agreed.into_iter().map(|t| t.join().unwrap()).collect()
    }

    #[test]
    fn ranks_copy_between_them_only_where_every_one_can_read_every_other() {
        let board = |forge: Option<(&str, Vec<u8>)>| match forge {
            Some((key, instead)) => InProcessStore::forging(key, instead),
            None => InProcessStore::default(),
        };
        assert_eq!(agree_on(board(None)), [true, true]);
        // Rank 5 publishes an address nothing is mapped at: rank 4 cannot
        // read it, and neither copies.
        let pid = std::process::id();
        let forge = ("peer-copy/where/5", format!("{pid} 0x8").into_bytes());
        assert_eq!(agree_on(board(Some(forge))), [false, false]);
        // A word that is not the probe's value.
        let wrong = 0x1234u64;
        let at = &raw const wrong as u64;
        let forge = ("peer-copy/where/5", format!("{pid} {at:#x}").into_bytes());
        assert_eq!(agree_on(board(Some(forge))), [false, false]);
    }

    #[test]
    fn places_read_back_as_published() {
        assert_eq!(parse_place(b"1234 0x7ffd00"), Some((1234, 0x7f_fd00)));
        assert_eq!(parse_place(b"1234"), None);
        assert_eq!(parse_place(b"x 0x10"), None);
    }
}
