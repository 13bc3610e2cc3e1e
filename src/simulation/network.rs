//! An in-memory fabric whose deliveries the simulation schedules.
//!
//! Posting a write or message only queues it on its (source, target) link; it
//! lands when the scheduler calls [`Network::deliver`] for that link. Each link
//! keeps its order (as tcp and RC queue pairs do); which link goes next, and when,
//! is the schedule's choice.

use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use fairring_rdma::fabric::{
    Completion, CompletionEvent, Endpoint, Fabric, FabricError, LocalRegion, Message, PeerFailure,
    RegionKey, RemoteRegion, WriteRequest,
};

/// Posts a link holds before it refuses more with `QueueFull`.
const LINK_DEPTH: usize = 6;

#[derive(Clone, Copy, Debug)]
enum Item {
    Write {
        /// The first byte sent: read when the write lands, as RDMA reads it
        /// some time after the post.
        source: usize,
        len: usize,
        /// The target's key: its staging region (the rank's number) or one
        /// of its windows.
        target_key: u32,
        target_offset: u64,
        immediate: u32,
        token: u64,
    },
    Message {
        message: Message,
        token: u64,
    },
}

/// Every rank's region, links and completions.
pub(super) struct Network {
    world: u32,
    /// Per rank: its registered region (address, length), the staging memory
    /// peers write into (tensors are registered to send from, or as windows).
    regions: Vec<Option<(usize, usize)>>,
    /// Per rank: its windows (`Fabric::register_window`).
    windows: Vec<Vec<Window>>,
    /// The key the next window gets: past every rank's staging key.
    next_window: u32,
    /// Writes landed in windows so far.
    pub(super) window_landings: u64,
    /// Whether `register_window` fails (a fabric out of registrations).
    pub(super) refuse_windows: bool,
    /// Per (source, target): posts in flight, in order.
    links: Vec<VecDeque<Item>>,
    /// Per (a, b): whether a connected to b.
    connected: Vec<bool>,
    completions: Vec<VecDeque<Completion>>,
    dead: Vec<bool>,
}

impl Network {
    pub(super) fn new(world: u32) -> Arc<Mutex<Network>> {
        let n = world as usize;
        Arc::new(Mutex::new(Network {
            world,
            regions: vec![None; n],
            windows: (0..n).map(|_| Vec::new()).collect(),
            next_window: world,
            window_landings: 0,
            refuse_windows: false,
            links: (0..n * n).map(|_| VecDeque::new()).collect(),
            connected: vec![false; n * n],
            completions: (0..n).map(|_| VecDeque::new()).collect(),
            dead: vec![false; n],
        }))
    }

    fn link(&self, from: u32, to: u32) -> usize {
        (from * self.world + to) as usize
    }

    /// Links with posts in flight, as (source, target).
    pub(super) fn busy_links(&self) -> Vec<(u32, u32)> {
        (0..self.world)
            .flat_map(|a| (0..self.world).map(move |b| (a, b)))
            .filter(|&(a, b)| !self.links[self.link(a, b)].is_empty())
            .collect()
    }

    /// Posts in flight on link `from -> to`.
    pub(super) fn in_flight(&self, from: u32, to: u32) -> usize {
        self.links[self.link(from, to)].len()
    }

    /// Lands the oldest post on link `from -> to`.
    pub(super) fn deliver(&mut self, from: u32, to: u32) {
        let l = self.link(from, to);
        let Some(item) = self.links[l].pop_front() else {
            return;
        };
        match item {
            Item::Write {
                source,
                len,
                target_key,
                target_offset,
                immediate,
                token,
            } => {
                let dst = if target_key == to {
                    self.regions[to as usize].map(|(address, _)| address)
                } else {
                    // A window closed since the post (its rank failed, or
                    // dropped it) takes nothing, as tcp refuses the write.
                    self.windows[to as usize]
                        .iter()
                        .find(|w| w.key == target_key && w.open)
                        .map(|w| w.address)
                };
                let Some(dst) = dst else {
                    return;
                };
                if target_key != to {
                    self.window_landings += 1;
                }
                let target = usize::try_from(target_offset).unwrap_or(usize::MAX);
                // Both ranges were bounds-checked against the registered regions
                // when posted (`WriteRequest::check`); the staging regions live
                // as long as the simulation's engines, and a tensor (a source,
                // or an open window) as long as its rank's record of the
                // scenario.
                let from_ptr = source as *const u8;
                let to_ptr = (dst as *mut u8).wrapping_add(target);
                // SAFETY: in bounds (above); the source is the writer's memory and
                // the target another rank's staging area, so they do not overlap.
                unsafe { std::ptr::copy_nonoverlapping(from_ptr, to_ptr, len) };
                self.completions[to as usize].push_back(Completion {
                    peer: from,
                    event: CompletionEvent::Landed {
                        len: len as u64,
                        immediate,
                    },
                });
                self.completions[from as usize].push_back(Completion {
                    peer: to,
                    event: CompletionEvent::Sent { token },
                });
            }
            Item::Message { message, token } => {
                self.completions[to as usize].push_back(Completion {
                    peer: from,
                    event: CompletionEvent::Message(message),
                });
                self.completions[from as usize].push_back(Completion {
                    peer: to,
                    event: CompletionEvent::Sent { token },
                });
            }
        }
    }

    /// Moves the newest completion of `rank` ahead of all the others: a
    /// provider that reports from several threads may report a message that
    /// arrived after one of its writes went out before that write's `Sent`.
    pub(super) fn report_newest_first(&mut self, rank: u32) {
        let q = &mut self.completions[rank as usize];
        if let Some(c) = q.pop_back() {
            q.push_front(c);
        }
    }

    /// Kills `rank` as SIGKILL would: what it had in flight is lost, and every
    /// rank connected to it learns that it closed its connections.
    pub(super) fn kill(&mut self, rank: u32) {
        self.dead[rank as usize] = true;
        for other in 0..self.world {
            let (a, b) = (self.link(rank, other), self.link(other, rank));
            self.links[a].clear();
            self.links[b].clear();
            if other != rank
                && (self.connected[a] || self.connected[b])
                && !self.dead[other as usize]
            {
                self.completions[other as usize].push_back(Completion {
                    peer: rank,
                    event: CompletionEvent::PeerFailed {
                        failure: PeerFailure::Closed,
                    },
                });
            }
        }
    }
}

fn lock(n: &Mutex<Network>) -> MutexGuard<'_, Network> {
    n.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One rank's view of the network.
pub(super) struct SimFabric {
    pub(super) rank: u32,
    pub(super) net: Arc<Mutex<Network>>,
}

/// A window of one rank.
#[derive(Clone, Copy, Debug)]
struct Window {
    key: u32,
    address: usize,
    open: bool,
}

/// A registered region: plain memory of the simulation.
pub(super) struct SimRegion {
    address: usize,
    len: usize,
    key: u32,
    /// For a window: the network it is registered with, and its rank.
    window: Option<(Arc<Mutex<Network>>, u32)>,
}

impl SimRegion {
    /// Sets whether the window is open; `false` if it is not a window.
    fn set_open(&self, open: bool) -> bool {
        let Some((net, rank)) = &self.window else {
            return false;
        };
        let mut net = lock(net);
        if let Some(w) = net.windows[*rank as usize]
            .iter_mut()
            .find(|w| w.key == self.key)
        {
            w.open = open;
        }
        true
    }
}

impl Drop for SimRegion {
    fn drop(&mut self) {
        if let Some((net, rank)) = &self.window {
            lock(net).windows[*rank as usize].retain(|w| w.key != self.key);
        }
    }
}

impl LocalRegion for SimRegion {
    fn key(&self) -> RegionKey {
        RegionKey(self.key)
    }

    fn len(&self) -> usize {
        self.len
    }

    fn remote(&self) -> RemoteRegion {
        RemoteRegion {
            key: self.key,
            address: self.address as u64,
            len: self.len as u64,
        }
    }

    fn as_ptr(&self) -> *mut u8 {
        self.address as *mut u8
    }
}

impl SimFabric {
    fn post(&self, peer: u32, item: Item) -> Result<(), FabricError> {
        let mut net = lock(&self.net);
        if peer >= net.world {
            return Err(FabricError::NotConnected { peer });
        }
        if net.dead[peer as usize] {
            return Err(FabricError::PeerFailed {
                peer,
                failure: PeerFailure::Closed,
            });
        }
        let l = net.link(self.rank, peer);
        if net.links[l].len() >= LINK_DEPTH {
            return Err(FabricError::QueueFull {
                peer,
                depth: LINK_DEPTH,
            });
        }
        net.links[l].push_back(item);
        Ok(())
    }
}

impl Fabric for SimFabric {
    type Region = SimRegion;

    fn rank(&self) -> u32 {
        self.rank
    }

    fn world_size(&self) -> u32 {
        lock(&self.net).world
    }

    fn endpoint(&self, _peer: u32) -> Result<Endpoint, FabricError> {
        Endpoint::from_bytes(&self.rank.to_le_bytes()).ok_or(FabricError::NotConnected { peer: 0 })
    }

    fn connect(&self, peer: u32, _endpoint: &Endpoint) -> Result<(), FabricError> {
        let mut net = lock(&self.net);
        let l = net.link(self.rank, peer);
        net.connected[l] = true;
        Ok(())
    }

    unsafe fn register(&self, memory: NonNull<u8>, len: usize) -> Result<SimRegion, FabricError> {
        let address = memory.as_ptr() as usize;
        lock(&self.net).regions[self.rank as usize] = Some((address, len));
        Ok(SimRegion {
            address,
            len,
            key: self.rank,
            window: None,
        })
    }

    fn registers_sources(&self) -> bool {
        true
    }

    unsafe fn register_source(
        &self,
        memory: NonNull<u8>,
        len: usize,
    ) -> Result<SimRegion, FabricError> {
        // Peers write only into the rank's staging region (`regions`): a key
        // no rank has.
        Ok(SimRegion {
            address: memory.as_ptr() as usize,
            len,
            key: u32::MAX,
            window: None,
        })
    }

    fn registers_windows(&self) -> bool {
        true
    }

    fn register_window(&self, memory: NonNull<u8>, len: usize) -> Result<SimRegion, FabricError> {
        let address = memory.as_ptr() as usize;
        let mut net = lock(&self.net);
        if net.refuse_windows {
            return Err(FabricError::InvalidArgument {
                argument: "window",
                reason: "the simulated fabric refuses windows".into(),
            });
        }
        let key = net.next_window;
        net.next_window += 1;
        net.windows[self.rank as usize].push(Window {
            key,
            address,
            open: false,
        });
        Ok(SimRegion {
            address,
            len,
            key,
            window: Some((Arc::clone(&self.net), self.rank)),
        })
    }

    unsafe fn open_window(&self, window: &SimRegion) -> Result<(), FabricError> {
        if window.set_open(true) {
            Ok(())
        } else {
            Err(FabricError::InvalidArgument {
                argument: "window",
                reason: "not a window".into(),
            })
        }
    }

    /// Writes land only when delivered, each under the network's lock: once
    /// this returns, none lands in the window.
    fn close_window(&self, window: &SimRegion) {
        window.set_open(false);
    }

    fn write(&self, peer: u32, request: WriteRequest<'_, SimRegion>) -> Result<(), FabricError> {
        request.check()?;
        self.post(
            peer,
            Item::Write {
                source: request.source.address.wrapping_add(request.source_offset),
                len: request.len,
                target_key: request.target.key,
                target_offset: request.target_offset,
                immediate: request.immediate,
                token: request.token,
            },
        )
    }

    fn send_message(
        &self,
        peer: u32,
        immediate: u32,
        payload: &[u8],
        token: u64,
    ) -> Result<(), FabricError> {
        fairring_rdma::fabric::check_message(payload)?;
        let message = Message::new(immediate, payload).expect("length checked above");
        self.post(peer, Item::Message { message, token })
    }

    fn poll(&self, out: &mut [Completion]) -> usize {
        let mut net = lock(&self.net);
        let q = &mut net.completions[self.rank as usize];
        let n = out.len().min(q.len());
        for slot in out.iter_mut().take(n) {
            if let Some(c) = q.pop_front() {
                *slot = c;
            }
        }
        n
    }

    fn wait(&self, out: &mut [Completion], _timeout: Duration) -> usize {
        self.poll(out)
    }
}
