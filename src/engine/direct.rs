//! Tensors the fabric sends from directly.
//!
//! A rank alone on its machine stages nothing for the machine: its slot is the
//! whole slice; and the ring never uses the machine's step. On a fabric that
//! registers memory to send from without pinning it (tcp:
//! [`Fabric::register_source`]) an all-reduce of a host tensor by either then
//! skips the copy into the staging buffer, and so does the root of a
//! broadcast relayed between such machines, whose chunks are all it sends
//! (a message is a broadcast from its sender, so a send copies nothing in),
//! beside dedicated servers too, which take no part in a relay (2x1 and 3x1
//! with two servers on two cores, medians of three alternating sittings: 4
//! MiB to 64 MiB in 1.17x to 1.55x less time, 1 MiB within the spread).
//! The tensor is registered, and what the rank sends of its own leaves from
//! it: hierarchical's contributions and served shard, the ring's chunks as it
//! reduces them, a broadcast root's chunks.
//! Reductions go into the tensor, from what landed in the staging buffer's
//! inbox. Only what other ranks finished is copied in, from where it landed.
//! Per rank and slice of `S` bytes that is `S (N-1)/N` bytes copied (`N`
//! machines, or ring ranks) instead of `2 S`: on loopback tcp the staging
//! copies cost as much CPU as the kernel's own (`perf`, 2x1, 16 MiB: 31% of
//! cycles in `memcpy`, 28% in the socket copies).
//!
//! Results still land in the staging buffer and are copied in, but between
//! two ranks of machines of their own, from `FAIRRING_DIRECT_FROM` on:
//! **landing in the tensor**. On a fabric whose registrations are table
//! entries ([`Fabric::register_window`]), the receiver of a broadcast, and
//! each rank of a hierarchical all-reduce that sends from its tensor,
//! registers its tensor as a *window*, opens it to the peer's writes when it
//! accepts the operation, and sends it beside its descriptor
//! ([`opens_window`]). The root of the broadcast, and the server of each
//! all-reduce shard, whose chunks or results leave from its own tensor, wait
//! for that descriptor before the first write ([`writes_into_window`]) and
//! write each at its offset in the receiver's tensor, marked
//! [`Kind::IntoTensor`](super::tags::Kind) so that the receiver copies
//! nothing; where the receiver opened none (its registration failed, or it
//! had another size threshold) they land in its staging buffer as before. A
//! message then moves from the sender's tensor to the receiver's with no copy
//! in either engine: on tcp, the receiver's socket reads go straight into the
//! tensor. A 2x1 all-reduce copies nothing at all: each rank sends its
//! contribution and its reduced shard from its tensor, reduces into its
//! tensor, and takes the other shard's result there. 2x1 tcp, two cores,
//! medians of five or six alternating rounds, busbw in GB/s with results
//! staged and landing in the tensor: 1 MiB 4.83 and 5.27, 4 MiB 3.76 and
//! 3.74, 16 MiB 2.06 and 2.14, 64 MiB 2.19 and 2.42, 256 MiB 2.16 and 2.40
//! (the copy's memory traffic gone, and with it the staged half of the
//! working set).
//!
//! An all-reduce's result lands in the cell its receiver sent its
//! contribution from, while the window is open. The receiver touches that
//! cell only before (its contribution leaves from it) and after (once the
//! result has landed), and the server writes it only after its whole
//! contribution has arrived, so the fabric has read it by then: a fabric
//! that registers sources reads one only until it has handed the last byte
//! on (`Fabric::register_source`; tcp, under the connection's lock, before
//! the peer can read that byte). A rank opens its window only where
//! it sends from its tensor (its send registration taken first): one that
//! stages its tensor would copy its slots back over the results. The window
//! closes, waiting for writes in flight (none are, once every chunk or
//! result has landed), before the operation completes; a failing engine
//! closes every window first too.
//!
//! Registrations are kept for the next operation on the same memory
//! ([`KeptRegions`]), so a training loop's all-reduces of the same buffers
//! register and allocate nothing once warm; a kept window is closed between
//! its operations, so no peer can write into memory its owner may have freed. A failing engine drops every
//! registration before it declares an operation finished: dropping one waits
//! until the fabric no longer reads the memory, so nothing reads a caller's
//! tensor after its operation has returned.

use std::ptr::NonNull;

use fairring_core::DataType;
use fairring_core::WireFormat;
use fairring_core::plan::Routing;
use fairring_rdma::fabric::Fabric;

use super::algorithm::{Context, Resolved};
use super::descriptor::Collective;
use super::work_table::{Submission, WORK_CAPACITY};
use crate::memory::{MemoryKind, MemorySpace};

/// Whether operation `sub` is a worker's, of at least `from_bytes` (`None`:
/// never), and lands in its own tensor (not delivered elsewhere).
fn large_enough<M: MemorySpace>(
    ctx: &Context<'_>,
    sub: &Submission<M>,
    from_bytes: Option<u64>,
) -> bool {
    let bytes = sub.elements().saturating_mul(sub.dtype().size_bytes());
    from_bytes.is_some_and(|from| bytes >= from) && sub.deliver.is_none() && ctx.server.is_none()
}

/// Whether operation `sub`, resolved to `algorithm`, may send from its tensor
/// directly in `ctx`, given the size from which that pays (`from_bytes`, `None`:
/// never): a hierarchical all-reduce between machines of one rank each, a
/// ring all-reduce, or the root of a broadcast relayed over ranks of machines
/// of their own (a message's sender among them). The memory space and the
/// fabric decide the rest.
pub(crate) fn eligible<M: MemorySpace>(
    ctx: &Context<'_>,
    sub: &Submission<M>,
    algorithm: Resolved,
    from_bytes: Option<u64>,
) -> bool {
    let large = large_enough(ctx, sub, from_bytes);
    let all_reduce = large && sub.descriptor.collective == Collective::AllReduce;
    match algorithm {
        // Its slot is the slice where the machine has one rank; servers and
        // a compressed wire reduce what the slot holds once it is sent. The
        // machines' own plan beside servers has the context of a job
        // without them (`Engine::context_for`); small tensors in groups
        // have their own, not flat.
        Resolved::Hierarchical | Resolved::Colocated | Resolved::Grouped => {
            let compressed = sub.wire() != WireFormat::Exact && sub.dtype() == DataType::F32;
            all_reduce
                && !compressed
                && ctx.topology.devices_per_machine() == 1
                && ctx.topology.machines() > 1
                && ctx.servers == 0
                && ctx.layout.routing() == Routing::Flat
        }
        // Every rank is a hop of its own, whatever machine it is on.
        Resolved::Ring => all_reduce && ctx.world > 1,
        // The root's chunks are all it sends, and each leaves as it is in
        // the tensor; over machines of several ranks the machine's
        // reduce-scatter puts them in place instead. Dedicated servers take
        // no part in a relay.
        Resolved::Relay => {
            large
                && sub.descriptor.collective == Collective::Broadcast
                && sub.descriptor.root == ctx.rank
                && ctx.world > 1
                && ctx.topology.devices_per_machine() == 1
        }
        // NCCL moves the bytes, not the engine's fabric.
        Resolved::Doubling | Resolved::Scatter | Resolved::Nccl => false,
    }
}

/// Whether operation `sub`, resolved to `algorithm`, may land in the
/// receivers' tensors (see the module docs), between two ranks, each a
/// machine of its own, without servers, on host memory, from `from_bytes` on:
/// a broadcast's chunks, or an all-reduce's results where it sends from its
/// tensor.
fn lands_in_tensor<M: MemorySpace>(
    ctx: &Context<'_>,
    sub: &Submission<M>,
    algorithm: Resolved,
    from_bytes: Option<u64>,
) -> bool {
    let between_two = sub.descriptor.memory == MemoryKind::Host
        && large_enough(ctx, sub, from_bytes)
        && ctx.servers == 0
        && ctx.world == 2
        && ctx.topology.devices_per_machine() == 1;
    match algorithm {
        Resolved::Relay => between_two && sub.descriptor.collective == Collective::Broadcast,
        Resolved::Hierarchical => {
            between_two && eligible(ctx, sub, Resolved::Hierarchical, from_bytes)
        }
        // Beside dedicated servers, which take every worker's descriptor,
        // results land in staging.
        Resolved::Ring
        | Resolved::Doubling
        | Resolved::Scatter
        | Resolved::Nccl
        | Resolved::Colocated
        | Resolved::Grouped => false,
    }
}

/// Whether this rank opens its tensor as a window for operation `sub`: it
/// receives a broadcast that may land in tensors, or takes part in an
/// all-reduce whose results may.
pub(crate) fn opens_window<M: MemorySpace>(
    ctx: &Context<'_>,
    sub: &Submission<M>,
    algorithm: Resolved,
    from_bytes: Option<u64>,
) -> bool {
    let receives = algorithm != Resolved::Relay || sub.descriptor.root != ctx.rank;
    receives && lands_in_tensor(ctx, sub, algorithm, from_bytes)
}

/// Whether this rank writes operation `sub`'s chunks (a broadcast's root) or
/// results (an all-reduce's server of a shard) into the receiver's window, if
/// it opened one, where it sends from its tensor. It then waits for the
/// receiver's descriptor, which says whether it did, before its first write.
pub(crate) fn writes_into_window<M: MemorySpace>(
    ctx: &Context<'_>,
    sub: &Submission<M>,
    algorithm: Resolved,
    from_bytes: Option<u64>,
) -> bool {
    let sends = algorithm != Resolved::Relay || sub.descriptor.root == ctx.rank;
    sends && lands_in_tensor(ctx, sub, algorithm, from_bytes)
}

/// What sending from tensors may do on one engine.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Settings {
    /// The size from which an all-reduce sends from its tensor where it may
    /// ([`eligible`]); `None`: never.
    pub(crate) from_bytes: Option<u64>,
    /// Registrations kept for reuse.
    pub(crate) cached: usize,
}

impl Settings {
    /// Sending from `from_bytes` on, keeping [`CACHED`] registrations.
    pub(crate) fn from(from_bytes: Option<u64>) -> Settings {
        Settings {
            from_bytes,
            cached: CACHED,
        }
    }
}

/// Registrations an engine keeps: more tensors than a training step's
/// gradient buckets.
pub(crate) const CACHED: usize = 64;

/// One kept registration.
struct Kept<R> {
    /// The memory it covers: first byte, length.
    memory: (usize, usize),
    region: R,
    /// Operations in flight that send from it.
    holders: u32,
    /// When an operation last took it (a count of takes).
    taken: u64,
}

/// The registrations of tensors the fabric sends from, kept for reuse.
///
/// Training all-reduces the same gradient buffers step after step: an
/// operation whose tensor (same first byte, same length) is registered
/// already takes that registration, so a warm engine registers nothing and
/// allocates nothing. A source registration leaves no window for peers and
/// pins nothing (`Fabric::register_source`), so keeping one after its
/// operation has completed is sound. One that no operation in flight holds
/// is dropped when its entry is needed for another tensor (least recently
/// taken first) or when the engine fails.
pub(crate) struct KeptRegions<R> {
    kept: Vec<Option<Kept<R>>>,
    /// Per entry of the work table (or the messages' table): the operation
    /// there, and its entry in `kept`.
    by_operation: Vec<Option<(u64, usize)>>,
    takes: u64,
}

impl<R> KeptRegions<R> {
    /// Room for `capacity` registrations, and one holder per entry of the
    /// work table.
    pub(crate) fn new(capacity: usize) -> KeptRegions<R> {
        KeptRegions::with_holders(capacity, WORK_CAPACITY)
    }

    /// Room for `capacity` registrations, and one holder per entry of a
    /// table of `holders` entries (entry `seq % holders` holds `seq`).
    pub(crate) fn with_holders(capacity: usize, holders: usize) -> KeptRegions<R> {
        KeptRegions {
            kept: (0..capacity).map(|_| None).collect(),
            by_operation: (0..holders.max(1)).map(|_| None).collect(),
            takes: 0,
        }
    }

    fn holder(&self, seq: u64) -> usize {
        #[expect(clippy::cast_possible_truncation, reason = "below the table's length")]
        let i = (seq % self.by_operation.len() as u64) as usize;
        i
    }

    /// The registration operation `seq` sends from, if it holds one.
    pub(crate) fn get(&self, seq: u64) -> Option<&R> {
        match self.by_operation[self.holder(seq)] {
            Some((s, at)) if s == seq => self.kept[at].as_ref().map(|k| &k.region),
            _ => None,
        }
    }

    /// Has operation `seq` hold a registration of `memory` (first byte,
    /// length): the one kept, or a new one from `register` in a free entry or
    /// in place of the least recently taken one nobody holds. Returns whether
    /// it holds one; `false` when every entry is held, or `register` failed.
    pub(crate) fn take(
        &mut self,
        seq: u64,
        memory: (usize, usize),
        register: impl FnOnce() -> Option<R>,
    ) -> bool {
        if self.get(seq).is_some() {
            return true;
        }
        self.takes += 1;
        let found = self
            .kept
            .iter()
            .position(|k| k.as_ref().is_some_and(|k| k.memory == memory));
        let at = match found {
            Some(at) => at,
            None => {
                let free = self.kept.iter().position(Option::is_none).or_else(|| {
                    self.kept
                        .iter()
                        .enumerate()
                        .filter_map(|(i, k)| k.as_ref().map(|k| (i, k)))
                        .filter(|(_, k)| k.holders == 0)
                        .min_by_key(|(_, k)| k.taken)
                        .map(|(i, _)| i)
                });
                let Some(at) = free else {
                    return false;
                };
                // The one it replaces, if any, drops first: nothing sends from
                // it (no holder), so that takes no wait.
                self.kept[at] = None;
                let Some(region) = register() else {
                    return false;
                };
                self.kept[at] = Some(Kept {
                    memory,
                    region,
                    holders: 0,
                    taken: 0,
                });
                at
            }
        };
        if let Some(k) = self.kept[at].as_mut() {
            k.holders += 1;
            k.taken = self.takes;
        }
        let holder = self.holder(seq);
        self.by_operation[holder] = Some((seq, at));
        true
    }

    /// Operations in flight that hold the registration operation `seq`
    /// holds (0 if it holds none).
    pub(crate) fn holders(&self, seq: u64) -> u32 {
        match self.by_operation[self.holder(seq)] {
            Some((s, at)) if s == seq => self.kept[at].as_ref().map_or(0, |k| k.holders),
            _ => 0,
        }
    }

    /// Operation `seq` has completed: every write from its tensor has too.
    pub(crate) fn release(&mut self, seq: u64) {
        let holder = self.holder(seq);
        let entry = &mut self.by_operation[holder];
        if let Some((s, at)) = *entry
            && s == seq
        {
            *entry = None;
            if let Some(k) = self.kept[at].as_mut() {
                k.holders = k.holders.saturating_sub(1);
            }
        }
    }

    /// Drops every registration (the engine failed): each drop waits until
    /// the fabric sends from it no more.
    pub(crate) fn clear(&mut self) {
        self.by_operation.iter_mut().for_each(|e| *e = None);
        self.kept.iter_mut().for_each(|k| *k = None);
    }
}

/// Registers `len` bytes at `ptr`, operation `seq`'s tensor, with `fabric` to
/// send from; `None` (the operation stages its tensor) if it refuses.
pub(crate) fn register<F: Fabric>(
    fabric: &F,
    ptr: NonNull<u8>,
    len: usize,
    seq: u64,
) -> Option<F::Region> {
    // The engine posts a write from the region only for an operation on this
    // memory while it is pending (valid, and not touched by the caller), keeps
    // the ranges it sends from unwritten until their writes complete
    // (`hierarchical`, `ring`) but for a result landing in a window over a
    // range the peer has every byte of (the module docs; `register_source`
    // allows it), and drops every registration before it declares an
    // operation failed (`fail_locked`).
    // SAFETY: by the above, while a write from the region is in flight its
    // source range is valid and unwritten: `register_source`'s contract.
    let registered = unsafe { fabric.register_source(ptr, len) };
    match registered {
        Ok(region) => Some(region),
        Err(e) => {
            log::debug!("fairring: operation #{seq} stages its tensor: registering it failed: {e}");
            None
        }
    }
}

/// Registers `len` bytes at `ptr`, operation `seq`'s tensor, with `fabric`
/// as a window (closed); `None` (the operation's chunks land in staging) if it
/// refuses.
pub(crate) fn register_window<F: Fabric>(
    fabric: &F,
    ptr: NonNull<u8>,
    len: usize,
    seq: u64,
) -> Option<F::Region> {
    match fabric.register_window(ptr, len) {
        Ok(region) => Some(region),
        Err(e) => {
            log::debug!(
                "fairring: operation #{seq} lands in staging: registering a window failed: {e}"
            );
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use fairring_core::ReduceOp;
    use fairring_core::plan::{Geometry, PlanConfig};
    use fairring_core::topology::{RankLayout, Topology};

    use super::*;
    use crate::engine::descriptor::Descriptor;
    use crate::engine::layout::BufferLayout;
    use crate::engine::work_table::Delivery;
    use crate::memory::{Host, HostTensor, MemoryKind};

    /// Whether a host `f32` all-reduce of 4 KiB, with `change` applied, may
    /// send from its tensor by `algorithm` on an `m x d` job with `servers`
    /// servers, from `from_bytes` on.
    fn allowed(
        (m, d, servers): (u32, u32, u32),
        algorithm: Resolved,
        from_bytes: Option<u64>,
        change: impl FnOnce(&mut Submission<Host>),
    ) -> bool {
        decide((m, d, servers), 0, algorithm, change, |ctx, sub| {
            eligible(ctx, sub, algorithm, from_bytes)
        })
    }

    /// What `decide` says of a host `f32` all-reduce of 4 KiB on rank `rank`,
    /// with `change` applied, on an `m x d` job with `servers` servers.
    fn decide(
        (m, d, servers): (u32, u32, u32),
        rank: u32,
        algorithm: Resolved,
        change: impl FnOnce(&mut Submission<Host>),
        decide: impl FnOnce(&Context<'_>, &Submission<Host>) -> bool,
    ) -> bool {
        let topology = Topology::new(m, d, RankLayout::Contiguous).unwrap();
        let geometry = Geometry::new(topology, PlanConfig::new(4096, 64).unwrap()).unwrap();
        let layout = BufferLayout::new(&geometry, m * d).unwrap();
        let ctx = Context {
            topology,
            location: topology.locate(rank).unwrap(),
            rank,
            world: m * d,
            layout: &layout,
            servers,
            server: None,
        };
        let mut buffer = vec![0u8; 4096];
        let descriptor = Descriptor {
            collective: Collective::AllReduce,
            dtype: DataType::F32,
            op: ReduceOp::Sum,
            algorithm,
            wire: WireFormat::Exact,
            memory: MemoryKind::Host,
            by_messages: false,
            root: 0,
            elements: 1024,
        };
        let mut sub = Submission::new(
            1,
            HostTensor::new(buffer.as_mut_ptr(), buffer.len()),
            descriptor,
            None,
            m * d,
        )
        .unwrap();
        change(&mut sub);
        decide(&ctx, &sub)
    }

    #[test]
    fn broadcasts_and_all_reduces_between_two_single_rank_machines_land_in_windows() {
        let broadcast = |root: u32, memory: MemoryKind| {
            move |s: &mut Submission<Host>| {
                s.descriptor.collective = Collective::Broadcast;
                s.descriptor.root = root;
                s.descriptor.memory = memory;
            }
        };
        let sides = |layout, rank, from: Option<u64>, change: &dyn Fn(&mut Submission<Host>)| {
            let opens = decide(layout, rank, Resolved::Relay, change, |ctx, sub| {
                opens_window(ctx, sub, Resolved::Relay, from)
            });
            let writes = decide(layout, rank, Resolved::Relay, change, |ctx, sub| {
                writes_into_window(ctx, sub, Resolved::Relay, from)
            });
            (opens, writes)
        };
        let host = MemoryKind::Host;
        // The receiver opens, the root writes; from the size on.
        assert_eq!(
            sides((2, 1, 0), 1, Some(4096), &broadcast(0, host)),
            (true, false)
        );
        assert_eq!(
            sides((2, 1, 0), 0, Some(4096), &broadcast(0, host)),
            (false, true)
        );
        assert_eq!(
            sides((2, 1, 0), 1, Some(4097), &broadcast(0, host)),
            (false, false)
        );
        assert_eq!(
            sides((2, 1, 0), 1, None, &broadcast(0, host)),
            (false, false)
        );
        // Not on one machine, not past two ranks (a chain forwards), not with
        // servers, not on device memory, not another collective.
        for layout in [(1, 2, 0), (3, 1, 0), (2, 1, 1)] {
            assert_eq!(
                sides(layout, 1, Some(0), &broadcast(0, host)),
                (false, false),
                "{layout:?}"
            );
        }
        let device = broadcast(0, MemoryKind::Device);
        assert_eq!(sides((2, 1, 0), 1, Some(0), &device), (false, false));
        assert_eq!(sides((2, 1, 0), 1, Some(0), &|_| {}), (false, false));

        // A hierarchical all-reduce sent from the tensors: every rank opens
        // and writes (the results of the shard it serves); from the size on.
        let all_reduce = |resolved: Resolved, layout, rank, from: Option<u64>, memory| {
            let change = move |s: &mut Submission<Host>| {
                s.descriptor.collective = Collective::AllReduce;
                s.descriptor.memory = memory;
            };
            let opens = decide(layout, rank, resolved, change, |ctx, sub| {
                opens_window(ctx, sub, resolved, from)
            });
            let writes = decide(layout, rank, resolved, change, |ctx, sub| {
                writes_into_window(ctx, sub, resolved, from)
            });
            (opens, writes)
        };
        let hierarchical = Resolved::Hierarchical;
        for rank in [0, 1] {
            assert_eq!(
                all_reduce(hierarchical, (2, 1, 0), rank, Some(4096), host),
                (true, true)
            );
            assert_eq!(
                all_reduce(hierarchical, (2, 1, 0), rank, Some(4097), host),
                (false, false)
            );
            assert_eq!(
                all_reduce(hierarchical, (2, 1, 0), rank, None, host),
                (false, false)
            );
        }
        // Not past two machines, not with several ranks a machine or with
        // servers, not on device memory, not by another algorithm.
        for layout in [(3, 1, 0), (2, 2, 0), (2, 1, 1)] {
            assert_eq!(
                all_reduce(hierarchical, layout, 1, Some(0), host),
                (false, false),
                "{layout:?}"
            );
        }
        let on_device = all_reduce(hierarchical, (2, 1, 0), 1, Some(0), MemoryKind::Device);
        assert_eq!(on_device, (false, false));
        for other in [Resolved::Ring, Resolved::Doubling] {
            assert_eq!(
                all_reduce(other, (2, 1, 0), 1, Some(0), host),
                (false, false),
                "{other:?}"
            );
        }
    }

    #[test]
    fn hierarchical_between_single_rank_machines_and_ring_all_reduces_send_from_tensors() {
        let hierarchical = Resolved::Hierarchical;
        let same = |_: &mut Submission<Host>| {};
        assert!(allowed((2, 1, 0), hierarchical, Some(4096), same));
        assert!(allowed((4, 1, 0), hierarchical, Some(0), same));
        // Below the size, or never.
        assert!(!allowed((2, 1, 0), hierarchical, Some(4097), same));
        assert!(!allowed((2, 1, 0), hierarchical, None, same));
        // Machines of several ranks stage for their local step; one machine
        // has no exchange; servers reduce what they are sent.
        assert!(!allowed((2, 2, 0), hierarchical, Some(0), same));
        assert!(!allowed((1, 1, 0), hierarchical, Some(0), same));
        assert!(!allowed((2, 1, 1), hierarchical, Some(0), same));
        // The ring, on any layout of several ranks, servers or not.
        for layout in [(2, 1, 0), (2, 2, 0), (1, 3, 0), (2, 1, 1)] {
            assert!(allowed(layout, Resolved::Ring, Some(0), same), "{layout:?}");
        }
        assert!(!allowed((1, 1, 0), Resolved::Ring, Some(0), same));
        assert!(!allowed((2, 1, 0), Resolved::Ring, Some(4097), same));
        // Other algorithms, collectives and wires stage.
        for other in [Resolved::Doubling, Resolved::Relay, Resolved::Scatter] {
            assert!(!allowed((2, 1, 0), other, Some(0), same), "{other}");
        }
        assert!(!allowed((2, 1, 0), hierarchical, Some(0), |s| {
            redescribe(s, |d| d.collective = Collective::Broadcast);
        }));
        assert!(!allowed((2, 1, 0), hierarchical, Some(0), |s| {
            s.deliver = Some(Delivery {
                to: s.tensor,
                range: 0..16,
            });
        }));
        assert!(!allowed((2, 1, 0), hierarchical, Some(0), |s| {
            redescribe(s, |d| d.wire = WireFormat::Bf16);
        }));
        // A compressed wire carries only f32: other types run exact.
        assert!(allowed((2, 1, 0), hierarchical, Some(0), |s| {
            redescribe(s, |d| {
                d.wire = WireFormat::Bf16;
                d.dtype = DataType::I32;
            });
        }));
    }

    /// A relayed broadcast's root sends its chunks from its tensor over
    /// machines of one rank each, beside dedicated servers too (which take
    /// no part in a relay); its other ranks, machines of several ranks (whose
    /// local step puts the chunks in place) and other collectives stage.
    #[test]
    fn a_relayed_broadcasts_root_sends_from_its_tensor_beside_servers_too() {
        let broadcast = |root: u32| {
            move |s: &mut Submission<Host>| {
                redescribe(s, |d| {
                    d.collective = Collective::Broadcast;
                    d.root = root;
                })
            }
        };
        let relay = Resolved::Relay;
        for layout in [(2, 1, 0), (3, 1, 0), (2, 1, 1), (3, 1, 2)] {
            assert!(allowed(layout, relay, Some(0), broadcast(0)), "{layout:?}");
            assert!(!allowed(layout, relay, Some(0), broadcast(1)), "{layout:?}");
            assert!(!allowed(layout, relay, None, broadcast(0)), "{layout:?}");
        }
        for layout in [(2, 2, 0), (2, 2, 2)] {
            assert!(!allowed(layout, relay, Some(0), broadcast(0)), "{layout:?}");
        }
        assert!(!allowed((2, 1, 1), relay, Some(0), |_| {}));
    }

    /// `s`, described as `change` makes its descriptor, running what that
    /// descriptor runs as.
    fn redescribe(s: &mut Submission<Host>, change: impl FnOnce(&mut Descriptor)) {
        let mut descriptor = s.descriptor;
        change(&mut descriptor);
        *s = Submission::new(s.seq, s.tensor, descriptor, s.deliver.take(), 2).unwrap();
    }

    #[test]
    fn operations_on_the_same_memory_share_one_registration() {
        let mut kept = KeptRegions::new(2);
        let mut made = 0;
        let mut register = |name: &'static str| {
            made += 1;
            Some(name)
        };
        assert!(kept.take(1, (100, 8), || register("a")));
        // A later slice of the same operation holds it already.
        assert!(kept.take(1, (100, 8), || unreachable!()));
        assert_eq!(kept.get(1), Some(&"a"));
        // Another operation on the same memory shares it; other memory gets
        // its own.
        assert!(kept.take(2, (100, 8), || unreachable!()));
        assert!(kept.take(3, (100, 16), || register("b")));
        assert_eq!((kept.get(2), kept.get(3)), (Some(&"a"), Some(&"b")));
        // Every entry held: a third tensor stages.
        assert!(!kept.take(4, (200, 8), || unreachable!()));
        assert_eq!(kept.get(4), None);
        // Once nobody holds one, a new tensor replaces the least recently
        // taken: "b" (taken by 3) was taken after "a" (by 2), but "a" is still
        // held by 1 until it completes.
        kept.release(3);
        assert!(kept.take(5, (200, 8), || register("c")));
        assert_eq!(kept.get(5), Some(&"c"));
        assert_eq!(kept.get(3), None);
        kept.release(1);
        kept.release(2);
        kept.release(5);
        assert!(
            kept.take(6, (200, 8), || unreachable!()),
            "kept after completion"
        );
        assert!(kept.take(7, (100, 16), || register("d")), "replaces a");
        assert_eq!((kept.get(6), kept.get(7)), (Some(&"c"), Some(&"d")));
        // A registration that fails leaves the operation staging.
        kept.release(7);
        assert!(!kept.take(8, (300, 8), || None));
        assert_eq!(made, 4);
        // A later operation in the same entry of the work table is another.
        let later = 6 + WORK_CAPACITY as u64;
        assert_eq!(kept.get(later), None);
        kept.release(later);
        assert_eq!(kept.get(6), Some(&"c"));
        kept.clear();
        assert_eq!(kept.get(6), None);
    }
}
