//! The engine: turns submissions, fabric completions and local progress into the
//! next step of every slice in flight.
//!
//! Data walks forward through it: a caller's **tensor** is cut into **slices**
//! (`slices`), each slice holds one staging buffer and runs its **algorithm**
//! (`algorithm/`), which moves it through the **local step** (`crate::local`),
//! the **staging** memory (`crate::memory`), the **fabric** (`outbox`,
//! `dispatch`), back into staging and through the local step into the tensor.
//!
//! The engine is generic over the fabric (`F`, chosen at run time by the
//! communicator) and the memory space (`M`: `crate::memory::Placed`, host or device
//! tensors, for a communicator; host memory for a server and the simulation). The
//! algorithms and the progress loop are written once for both.
//!
//! # Where each idea lives
//!
//! | module | what it holds |
//! |---|---|
//! | `mod.rs` | the [`Engine`], its construction, and submission |
//! | `work_table` | the table of operations shared with callers (sequence numbers, done or failed) |
//! | `planner` | what the caller's thread fixes per operation, in submission order: its plan, its slices' numbers, its device program enqueued |
//! | `operations` | the operations the driver has accepted: plans, slices started and done, completion |
//! | `slices` | the staging buffers: the slice holding each, starting and releasing slices, early landings |
//! | `choice` | what a call runs: algorithm, wire format, zero-fill; its rules as a table the tests check |
//! | `algorithm/` | the algorithms as types, events in, steps out: `hierarchical`, `ring`, `doubling` (all-reduce), `relay` (broadcast, all-gather), `scatter` (reduce-scatter), `serve` (a dedicated server's part) |
//! | `steps` | performing a slice's steps over memory, local step and outbox; polling what is still running |
//! | `layout` | the one layout of a staging buffer |
//! | `outbox` | everything sent: data writes waiting for credit or room, control messages |
//! | `credits` | the credit window (flow control) |
//! | `direct` | tensors the fabric sends from, registered per operation |
//! | `device_program` | what an operation on device tensors asks of the device, enumerated for the caller to enqueue, and the check holding each running slice to it |
//! | `descriptor`, `checks` | what each operation is, and the checks that ranks issued the same one |
//! | `dispatch` | routing each fabric completion |
//! | `failure`, `departures` | failing and flooding the failure; goodbyes |
//! | `drive` | one pass of the driver |
//! | `progress/` | who drives and when: the progress thread, waiting callers, parking |
//! | `serving` | a dedicated server's operations, learnt from the workers' descriptors |
//! | `stall` | what a stalled engine waits for, in words |
//! | `links` | the fabric and the connections to this rank's peers (whom the algorithms need: `algorithm/peers`) |
//! | `messages/` | point-to-point messages: posted, linked to their peers, matched per (peer, tag), moved from tensor to tensor |
//! | `tags` | immediates and tokens |
//!
//! # Memory
//!
//! Nothing here allocates once a communicator is built: submissions go through a
//! fixed queue, operations through a fixed table, waiting writes, early landings,
//! steps and events through vectors sized at construction. The one exception is
//! the first all-reduce that sends from a given tensor (`direct`): the tcp
//! fabric allocates that tensor's registration, which the engine keeps for the
//! next all-reduce of the same memory.

pub(crate) mod algorithm;
mod checks;
pub(crate) mod choice;
#[cfg(feature = "cuda")]
pub(crate) use choice::nccl_across_job_may_run;
pub use choice::{NCCL_ACROSS_UP_TO_MACHINES, nccl_across_job, nccl_beside_servers};
mod credits;
mod departures;
pub(crate) mod descriptor;
mod device_program;
mod direct;
mod dispatch;
mod drive;
mod failure;
pub(crate) mod layout;
pub(crate) mod links;
pub(crate) mod messages;
mod operations;
mod outbox;
mod planner;
mod progress;
mod serving;
mod slices;
mod stall;
mod steps;
pub(crate) mod tags;
pub(crate) mod work_table;

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;
use fairring_core::plan::{Geometry, PlanConfig, TREE_PARTS};
use fairring_core::topology::{Location, RankLayout, Topology};
use fairring_rdma::fabric::{Completion, Fabric, RemoteRegion};

pub(crate) use algorithm::{Resolved, Wiring};
use algorithm::{SliceEvent, Step, relay_most_writes};
use checks::Checks;
use credits::Credits;
use departures::Departures;
use direct::KeptRegions;
pub(crate) use direct::Settings as DirectSettings;
use failure::FailureState;
use layout::BufferLayout;
use links::Links;
use links::NO_COMPLETION;
use operations::Operations;
use outbox::Outbox;
use planner::{Accepted, Planner};
use progress::park::{Parking, Wake};
use slices::Slices;
use work_table::{Submission, WORK_CAPACITY, WorkTable};

use crate::error::{Error, Result};
use crate::local::{LocalStep, Machine};
use crate::memory::MemorySpace;
use crate::shm::Segment;

/// Completions taken per poll.
const POLL_BATCH: usize = 256;

/// Vectors the driver reuses on every pass.
struct Scratch {
    completions: Vec<Completion>,
    /// Completions the progress thread waited for.
    waited: Vec<Completion>,
    steps: Vec<Step>,
    events: VecDeque<SliceEvent>,
}

/// Everything the driver mutates.
pub(crate) struct Driver<M: MemorySpace> {
    operations: Operations<M>,
    slices: Slices<M>,
    credits: Credits,
    checks: Checks,
    outbox: Outbox,
    departures: Departures,
    scratch: Scratch,
    last_progress: Instant,
    /// Once the engine failed: what it has yet to settle.
    failing: Option<failure::Failing>,
}

/// The engine of one communicator.
pub(crate) struct Engine<F: Fabric, M: MemorySpace> {
    pub(crate) links: Links<F>,
    pub(crate) memory: M,
    local: Box<dyn LocalStep<M>>,
    machine: Machine,
    pub(crate) geometry: Geometry,
    /// The geometry recursive doubling plans with: slices that fit its receive
    /// slots (`None` only if the layout broke its promise of a line per slot).
    doubling_geometry: Option<Geometry>,
    /// The geometry a reduce-scatter plans its shares with: slices of one
    /// piece (`None` only if the layout broke its promise of a line per piece).
    scatter_geometry: Option<Geometry>,
    /// The geometry of the workers' NCCL all-reduce (`algorithm/nccl.rs`):
    /// one machine of the workers' devices per machine, whose one slice is
    /// the whole tensor (a dedicated server plans it too, and serves none
    /// of it).
    nccl_geometry: Option<Geometry>,
    /// The job's second geometry ([`layout`]'s docs): beside dedicated
    /// servers the machines' own plan (`Resolved::Colocated`,
    /// [`layout::colocated_geometry`]; a dedicated server plans it too, and
    /// serves none of it); on the flat plan, its small tensors in groups
    /// (`Resolved::Grouped`, [`layout::grouped_geometry`]). `None` where the
    /// job has none.
    second_geometry: Option<Geometry>,
    layout: BufferLayout,
    /// The layout the second geometry takes in the same buffers
    /// ([`BufferLayout::second`]): `layout` where there is none.
    second_layout: BufferLayout,
    pub(crate) buffers: u32,
    pub(crate) works: WorkTable,
    /// Plans operations on the callers' threads, in submission order.
    planner: Mutex<Planner<M>>,
    submissions: ArrayQueue<Accepted<M>>,
    driver: Mutex<Driver<M>>,
    failure: FailureState,
    parking: Parking,
    epoch: Instant,
    pub(crate) timeout: Duration,
    /// Whether any operation may use the fabric (more than one rank).
    uses_fabric: bool,
    /// Whether data from other machines (or servers) reaches this rank: only then
    /// does an idle driver take the fabric's arrivals itself
    /// ([`Fabric::progress`]), which costs a system call per peer.
    remote: bool,
    /// Whether every event the engine waits for rings the local doorbell: local
    /// ranks' progress always does, and fabric completions do when the fabric
    /// takes a notifier. Otherwise the progress thread waits on the fabric.
    doorbell_wakes: bool,
    /// Whether spinners leave their core each round: this machine has fewer
    /// cores than local ranks, or remote data arrives through a fabric thread.
    crowded: bool,
    /// When a spinner of this rank last moved off a core it shared with a
    /// local rank, in [`Engine::nanos`] (0: never; `local::shared_core`).
    last_move: crate::sync::unmodelled::AtomicU64,
    /// Dedicated servers in the job (0: the machines serve).
    servers: u32,
    /// This process's index if it is a dedicated server.
    pub(crate) server: Option<u32>,
    /// Bytes from one staging buffer to the next: a worker's, a server's.
    strides: Strides,
    /// The size from which a hierarchical all-reduce sends from its tensor
    /// directly where it may (`direct`); `None`: never.
    direct_from: Option<u64>,
    /// The registrations of tensors sent from. Only the driver takes the
    /// lock, while it holds the driver's.
    source_regions: Mutex<KeptRegions<F::Region>>,
    /// The windows of tensors peers write into (`direct`), open while an
    /// operation holds them. Only the driver takes the lock, while it holds
    /// the driver's.
    windows: Mutex<KeptRegions<F::Region>>,
    /// Point-to-point messages: what callers share with the driver.
    pub(crate) messages: messages::Board,
    /// Which peers messages may reach, and the linker's queue.
    pub(crate) late_links: messages::LateLinks,
    /// The messages the driver holds. Only the driver takes the lock, while
    /// it holds the driver's.
    transfers: Mutex<messages::Transfers<F::Region>>,
    /// Where the machine's ranks read each other's memory: messages between
    /// them go through the machine's mailboxes.
    peer_copy: Option<std::sync::Arc<crate::local::PeerCopy>>,
    /// Per rank: whether messages with it go through the mailboxes.
    through_mailboxes: Vec<bool>,
}

/// Bytes from one staging buffer to the next in a process's registered memory,
/// for the addresses of writes into peers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Strides {
    /// In a worker's.
    pub(crate) worker: usize,
    /// In a dedicated server's.
    pub(crate) server: usize,
}

/// Everything [`Engine::new`] needs.
pub(crate) struct EngineParts<F: Fabric, M: MemorySpace> {
    pub(crate) fabric: F,
    /// `memory`'s staging buffers, registered with `fabric`.
    pub(crate) region: F::Region,
    /// Per rank: its staging buffers, for the ranks this rank writes to.
    pub(crate) remote: Vec<Option<RemoteRegion>>,
    pub(crate) memory: M,
    pub(crate) local: Box<dyn LocalStep<M>>,
    pub(crate) machine: Machine,
    pub(crate) geometry: Geometry,
    pub(crate) layout: BufferLayout,
    pub(crate) location: Location,
    pub(crate) rank: u32,
    /// Processes on the fabric: workers and dedicated servers.
    pub(crate) world: u32,
    /// Dedicated servers in the job.
    pub(crate) servers: u32,
    /// This process's index if it is a dedicated server.
    pub(crate) server: Option<u32>,
    pub(crate) buffers: u32,
    /// Whom this process writes to, hears from and links with.
    pub(crate) wiring: Wiring,
    pub(crate) timeout: Duration,
    /// Sending from tensors (`direct`).
    pub(crate) direct: direct::Settings,
    /// Where the machine's ranks read each other's memory: messages between
    /// them go through the machine's mailboxes (`messages`).
    pub(crate) peer_copy: Option<std::sync::Arc<crate::local::PeerCopy>>,
}

/// The geometry of the job's NCCL all-reduce: one machine of `geometry`'s
/// devices (their slots are the local step's), planned whole.
fn one_machine_geometry(geometry: &Geometry) -> Option<Geometry> {
    let devices = geometry.topology().devices_per_machine();
    let machine = Topology::new(1, devices, RankLayout::Contiguous).ok()?;
    Geometry::new(machine, geometry.config()).ok()
}

/// A geometry that cuts operations into slices of at most `bytes` (a multiple
/// of 64) and nothing finer: recursive doubling and the reduce-scatter move a
/// slice whole, never by the slots and shards of `geometry`'s layout, so they
/// plan as on a single device, whose full slice is exactly `bytes` whatever the
/// job's devices per machine.
fn unsplit_geometry(geometry: &Geometry, bytes: usize) -> Option<Geometry> {
    let config = PlanConfig::new(u64::try_from(bytes).ok()?, geometry.min_shard_bytes()).ok()?;
    let alone = Topology::new(1, 1, RankLayout::Contiguous).ok()?;
    Geometry::new(alone, config).ok()
}

impl<F: Fabric, M: MemorySpace> Engine<F, M> {
    pub(crate) fn new(parts: EngineParts<F, M>) -> Engine<F, M> {
        let topology = parts.geometry.topology();
        let world = parts.world;
        let machines = topology.machines() as usize;
        let workers = parts.geometry.topology().world_size();
        let peer_copy = parts.peer_copy.filter(|p| p.fits_the_copy_words());
        let second = parts.layout.second(workers);
        let mut mailbox_peers = Vec::new();
        let late_links = messages::LateLinks::new(
            parts.geometry.topology().world_size(),
            parts.rank,
            &parts.wiring.linked,
        );
        let links = Links::new(
            parts.fabric,
            parts.region,
            parts.remote,
            topology,
            parts.location,
            parts.rank,
            world,
            parts.wiring.inbound,
            parts.wiring.linked,
        );
        if peer_copy.is_some() {
            mailbox_peers = links.local_indices(world);
            mailbox_peers.truncate(workers as usize);
        }
        mailbox_peers.resize(workers as usize, None);
        let through_mailboxes = mailbox_peers.iter().map(Option::is_some).collect();
        // The most writes, early landings and steps one slice can have at once:
        // a contribution or result per other machine, a ring step per rank, a
        // relayed chunk per piece of the slice; through the trees two
        // children's contributions and at most three results (two leaf cells'
        // and the inner cell's from its parent), each in up to `TREE_PARTS`
        // parts.
        let most = (2 * (world as usize).max(machines) + 4)
            .max(2 * relay_most_writes(world))
            .max(5 * TREE_PARTS as usize);
        let doorbell_wakes = world <= 1 || links.fabric.notify_completions(parts.machine.waker());
        // A spinner leaves its core to other threads each round when local ranks
        // outnumber cores, and when data from other machines reaches this rank
        // through a thread of the fabric's own (one that can ring the doorbell):
        // spinning undisturbed there keeps that thread from running (on two
        // cores, 2x1 tcp all-reduces of 4 KiB took one spin limit, 100 us, per
        // hop).
        let remote = machines > 1 || parts.servers > 0;
        let fabric_thread = remote && world > 1 && doorbell_wakes;
        let crowded = fabric_thread
            || std::thread::available_parallelism().map_or(true, |cores| {
                cores.get() < topology.devices_per_machine() as usize
            });
        Engine {
            driver: Mutex::new(Driver {
                operations: Operations::new(),
                slices: Slices::new(parts.buffers, most),
                credits: Credits::new(parts.buffers, links.local_indices(world)),
                checks: Checks::new(world, &links.remote_in),
                outbox: Outbox::new(parts.buffers, most),
                departures: Departures::new(world),
                scratch: Scratch {
                    completions: vec![NO_COMPLETION; POLL_BATCH],
                    waited: vec![NO_COMPLETION; POLL_BATCH],
                    steps: Vec::with_capacity(most),
                    events: VecDeque::with_capacity(most),
                },
                last_progress: Instant::now(),
                failing: None,
            }),
            links,
            memory: parts.memory,
            local: parts.local,
            machine: parts.machine,
            geometry: parts.geometry,
            doubling_geometry: unsplit_geometry(
                &parts.geometry,
                parts.layout.doubling_slice_bytes(),
            ),
            scatter_geometry: unsplit_geometry(&parts.geometry, parts.layout.scatter_piece_bytes()),
            nccl_geometry: one_machine_geometry(&parts.geometry),
            second_geometry: second.map(|(geometry, _)| geometry),
            layout: parts.layout,
            second_layout: second.map_or(parts.layout, |(_, layout)| layout),
            buffers: parts.buffers,
            works: WorkTable::new(),
            planner: Mutex::new(Planner::new()),
            submissions: ArrayQueue::new(WORK_CAPACITY),
            failure: FailureState::new(),
            parking: Parking::new(),
            epoch: Instant::now(),
            timeout: parts.timeout,
            uses_fabric: world > 1,
            remote: remote && world > 1,
            doorbell_wakes,
            crowded,
            last_move: crate::sync::unmodelled::AtomicU64::new(0),
            servers: parts.servers,
            server: parts.server,
            strides: Strides {
                worker: Segment::buffer_stride(parts.layout.buffer_bytes()),
                server: Segment::buffer_stride(parts.layout.server_buffer_bytes()),
            },
            direct_from: parts.direct.from_bytes,
            source_regions: Mutex::new(KeptRegions::new(parts.direct.cached)),
            windows: Mutex::new(KeptRegions::new(parts.direct.cached)),
            messages: messages::Board::new(),
            late_links,
            transfers: Mutex::new(messages::Transfers::new(workers, mailbox_peers)),
            peer_copy,
            through_mailboxes,
        }
    }

    /// Bytes from one staging buffer to the next in `peer`'s registered memory.
    pub(crate) fn stride_of(&self, peer: u32) -> usize {
        if peer >= self.geometry.topology().world_size() {
            self.strides.server
        } else {
            self.strides.worker
        }
    }

    /// Whether the machines can serve their own shards beside dedicated
    /// servers (`Resolved::Colocated`): the job plans without servers too.
    pub(crate) fn machines_can_serve(&self) -> bool {
        self.servers > 0 && self.second_geometry.is_some()
    }

    /// The job's flat geometry, where its small tensors plan in groups
    /// (`Resolved::Grouped`, [`layout::takes_groups`]).
    pub(crate) fn groups_for_small_tensors(&self) -> Option<Geometry> {
        (self.servers == 0 && self.second_geometry.is_some()).then_some(self.geometry)
    }

    /// This rank.
    pub(crate) fn rank(&self) -> u32 {
        self.links.rank
    }

    /// Ranks in the job (workers: dedicated servers are not counted).
    pub(crate) fn world(&self) -> u32 {
        self.geometry.topology().world_size()
    }

    /// The first error, if the engine has failed.
    pub(crate) fn failure(&self) -> Option<Error> {
        self.failure.first()
    }

    /// Queues an operation. The caller has taken its table entry.
    ///
    /// On the caller's thread, in submission order: the operation is planned
    /// and its slices numbered here, and an operation on device tensors has
    /// its whole device program enqueued ([`device_program`]), so that the
    /// progress thread never makes a CUDA call for it. Refused (`Err`) only
    /// before anything is enqueued; once its program is on the device, the
    /// operation is accepted, and fails as an operation if it cannot run.
    pub(crate) fn submit(&self, sub: Submission<M>) -> Result<()> {
        if let Some(e) = self.failure() {
            return Err(Error::Failed { first: Box::new(e) });
        }
        let mut planner = self.lock_planner();
        let (accepted, refused) = self.plan(&mut planner, sub)?;
        if let Some(e) = refused {
            // Its program could not be enqueued whole: the engine fails, and
            // the operation with it, before the driver can start a slice of
            // it (a stage left out must never pass for one that ran). The
            // planner stays locked, so no later operation is numbered after
            // it first.
            self.fail_with(accepted, e);
            return Ok(());
        }
        self.parking.submitting();
        let queued = self.submissions.push(accepted);
        if let Err(accepted) = queued {
            self.parking.finished();
            let error = Error::internal(
                "the operation table bounds the submissions queued",
                format!("more than {WORK_CAPACITY} queued"),
            );
            // Its slices are numbered: the engine fails rather than run the
            // next operation's out of order.
            if accepted.device.is_none() {
                self.fail(error.clone());
                return Err(error);
            }
            self.fail_with(accepted, error);
            return Ok(());
        }
        drop(planner);
        if self.parking.submitted(self.nanos()) == Wake::Doorbell {
            self.machine.doorbell().ring();
        }
        Ok(())
    }

    /// Marks operation `seq` finished, then releases the streams waiting for
    /// it.
    ///
    /// The order pairs with [`awaits_on_device`](Engine::awaits_on_device):
    /// the state is published before the memory space is asked to release
    /// streams, and a caller's wait makes the memory space's waiting words
    /// exist before it reads the state, each with a `SeqCst` fence between.
    /// So either this completion sees the words and sets operation `seq`'s,
    /// or the caller sees the operation finished and enqueues no wait: no
    /// stream waits on a word that is never set (an operation that finished
    /// before the device side existed, as a host barrier).
    fn complete(&self, seq: u64, state: u32) {
        let finished = self
            .works
            .finish_then_release(seq, state, || self.memory.completed(seq));
        if finished {
            self.parking.finished();
        }
    }

    /// Whether a caller's stream must wait on the device for operation `seq`:
    /// it has not finished. The caller has made the memory space's waiting
    /// words exist before asking (see [`complete`](Engine::complete)).
    #[cfg(any(feature = "cuda", all(test, not(loom))))]
    pub(crate) fn awaits_on_device(&self, seq: u64) -> bool {
        self.works.pending_for_a_wait(seq)
    }

    fn lock_planner(&self) -> MutexGuard<'_, Planner<M>> {
        self.planner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether a panic poisoned the driver's lock (the simulation checks that a
    /// panicking local step leaves it clean).
    #[cfg(all(test, not(loom)))]
    pub(crate) fn driver_is_poisoned(&self) -> bool {
        self.driver.is_poisoned()
    }

    fn lock_driver(&self) -> MutexGuard<'_, Driver<M>> {
        self.driver.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn lock_source_regions(&self) -> MutexGuard<'_, KeptRegions<F::Region>> {
        self.source_regions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn lock_windows(&self) -> MutexGuard<'_, KeptRegions<F::Region>> {
        self.windows.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn lock_transfers(&self) -> MutexGuard<'_, messages::Transfers<F::Region>> {
        self.transfers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes entry `seq` of `table` (the operations' or the messages'),
    /// driving while it is held, until the engine fails or the timeout
    /// passes; `what` names the entry and how many there are, for the error
    /// (made only then: a warm submission allocates nothing).
    pub(crate) fn take_entry(
        &self,
        table: &WorkTable,
        seq: u64,
        what: impl FnOnce() -> String,
    ) -> Result<()> {
        let start = Instant::now();
        let mut drove = false;
        while !table.try_take(seq) {
            drove = true;
            if let Some(e) = self.failure() {
                return Err(Error::Failed { first: Box::new(e) });
            }
            if start.elapsed() > self.timeout {
                return Err(Error::timeout(
                    format!("{}; wait on or drop earlier ones", what()),
                    self.timeout,
                ));
            }
            if !self.try_drive() {
                std::thread::yield_now();
            }
        }
        if drove && self.remote {
            self.links.fabric.spinner_leaves();
        }
        Ok(())
    }

    /// Wakes whoever drives or waits: something they wait for changed.
    pub(crate) fn ring(&self) {
        self.machine.doorbell().ring();
    }

    /// Whether messages with `peer` go through the machine's mailboxes (and
    /// need no connection of the fabric).
    pub(crate) fn messages_go_local(&self, peer: u32) -> bool {
        self.through_mailboxes
            .get(peer as usize)
            .copied()
            .unwrap_or(false)
    }

    /// Every peer this rank has a connection to: its collectives' and those
    /// its messages made since.
    pub(crate) fn every_linked(&self) -> impl Iterator<Item = u32> + '_ {
        let late = self
            .late_links
            .linked()
            .filter(|p| !self.links.linked.contains(p));
        self.links.linked.iter().copied().chain(late)
    }
}
