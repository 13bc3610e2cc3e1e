//! [`Fusion`]: balanced fusion buffers placed without negotiation (Herring,
//! sections III-1 and III-2), over fairring-core's planner
//! ([`plan_fusion`](fairring_core::fusion::plan_fusion)).
//!
//! A training step hands its gradients over one by one, in whatever order the
//! backward pass produces them, which differs from rank to rank. Every rank must
//! nonetheless put every gradient at the same offset of the same buffer and
//! all-reduce the same buffers in the same order. Herring's answer, and this one:
//! the order rank 0 saw in the **first** step fixes the placement for good (rank 0
//! broadcasts it once); from the second step on, each gradient is copied into its
//! place as it arrives, and a buffer's all-reduce starts as soon as its last
//! gradient is in (and every earlier buffer's has started: all ranks issue the
//! buffers in order). Every buffer but the last is exactly full, so dedicated
//! servers receive equal shares of each.
#![expect(
    clippy::cast_possible_truncation,
    reason = "every byte and element count here comes from the lengths of slices in memory, \
              so it fits usize"
)]

use fairring_core::ReduceOp;
use fairring_core::fusion::{FusionPlan, Position, plan_fusion};
use fairring_core::reduce::Element;

use crate::communicator::{Communicator, Work};
use crate::error::{Error, Result};

/// The fusion buffers of one set of tensors (a model's gradients), reused step
/// after step.
pub struct Fusion<T: Element> {
    /// Elements of each tensor, by index.
    sizes: Vec<usize>,
    buffer_elements: usize,
    /// The placement, once the first step has fixed the order.
    placed: Option<Placement>,
    buffers: Vec<Vec<T>>,
}

struct Placement {
    plan: FusionPlan,
    /// Per tensor (by index): where it starts.
    positions: Vec<Position>,
    /// Per buffer: how many tensors have bytes in it.
    members: Vec<usize>,
    /// Per tensor: the buffers it touches.
    touches: Vec<std::ops::Range<usize>>,
}

impl<T: Element> Fusion<T> {
    /// Fusion buffers of `buffer_bytes` (rounded down to whole elements) for
    /// tensors of `sizes` elements, indexed `0..sizes.len()` on every rank alike.
    pub fn new(sizes: &[usize], buffer_bytes: usize) -> Result<Fusion<T>> {
        let size = std::mem::size_of::<T>();
        let buffer_elements = buffer_bytes / size;
        if buffer_elements == 0 {
            return Err(Error::invalid(
                "buffer_bytes",
                format!("{buffer_bytes} bytes hold no {}", T::DTYPE),
            ));
        }
        Ok(Fusion {
            sizes: sizes.to_vec(),
            buffer_elements,
            placed: None,
            buffers: Vec::new(),
        })
    }

    /// Where tensor `index` lives once the order is fixed: its buffer and its
    /// element offset there (`None` before the first step).
    pub fn position(&self, index: usize) -> Option<(u64, u64)> {
        let size = std::mem::size_of::<T>() as u64;
        let p = self.placed.as_ref()?.positions.get(index)?;
        Some((p.buffer, p.offset / size))
    }

    /// Fusion buffers, once placed.
    pub fn buffers(&self) -> usize {
        self.buffers.len()
    }

    /// All-reduces every tensor of the set, handed over as `(index, tensor)` in
    /// any order (an iterator that yields each gradient when it is ready); returns
    /// once every tensor holds its result. Every index must come exactly once with
    /// its declared length.
    ///
    /// The first call takes every tensor before it starts, to learn rank 0's
    /// order; later calls start each buffer as soon as its tensors are in.
    pub fn all_reduce<'t>(
        &mut self,
        comm: &Communicator,
        tensors: impl IntoIterator<Item = (usize, &'t mut [T])>,
        op: ReduceOp,
    ) -> Result<()> {
        let mut held: Vec<Option<&'t mut [T]>> = (0..self.sizes.len()).map(|_| None).collect();
        let mut arrival = Vec::with_capacity(self.sizes.len());
        let mut tensors = tensors.into_iter();
        if self.placed.is_none() {
            for (index, t) in tensors.by_ref() {
                hold(&self.sizes, &mut held, index, t)?;
                arrival.push(index);
            }
            self.place(comm, &arrival)?;
        }
        let Some(placed) = self.placed.as_ref() else {
            return Err(Error::internal("the first step places", "no placement"));
        };
        let mut waiting = placed.members.clone();
        let mut buffers: Vec<Option<&mut [T]>> = self
            .buffers
            .iter_mut()
            .enumerate()
            .map(|(b, buf)| {
                let len = placed.plan.buffer_len(b as u64) as usize / std::mem::size_of::<T>();
                Some(&mut buf[..len])
            })
            .collect();
        let sizes = &self.sizes;
        comm.scope(|s| -> Result<()> {
            let mut works: Vec<Work<'_>> = Vec::with_capacity(buffers.len());
            let mut next = 0;
            // Starts, in order, every buffer whose tensors are all in.
            macro_rules! start_ready {
                () => {
                    while next < buffers.len() && waiting[next] == 0 {
                        if let Some(buf) = buffers[next].take() {
                            works.push(s.all_reduce(buf, op, ())?);
                        }
                        next += 1;
                    }
                };
            }
            for &index in &arrival {
                let t = held[index].as_deref().unwrap_or(&[]);
                arrived(placed, sizes[index], index, t, &mut buffers, &mut waiting);
            }
            start_ready!();
            for (index, t) in tensors.by_ref() {
                hold(sizes, &mut held, index, t)?;
                let t = held[index].as_deref().unwrap_or(&[]);
                arrived(placed, sizes[index], index, t, &mut buffers, &mut waiting);
                start_ready!();
            }
            if let Some(missing) = held.iter().position(Option::is_none) {
                return Err(Error::invalid(
                    "tensors",
                    format!("tensor {missing} was not handed over"),
                ));
            }
            works.into_iter().try_for_each(Work::wait)
        })?;
        for (index, t) in held.iter_mut().enumerate() {
            if let Some(t) = t {
                copy_out(placed, index, t, &self.buffers);
            }
        }
        Ok(())
    }

    /// Fixes the placement from rank 0's `arrival` order, broadcast to every rank.
    fn place(&mut self, comm: &Communicator, arrival: &[usize]) -> Result<()> {
        if arrival.len() != self.sizes.len() {
            return Err(Error::invalid(
                "tensors",
                format!(
                    "the first step handed over {} of {} tensors",
                    arrival.len(),
                    self.sizes.len()
                ),
            ));
        }
        let mut order: Vec<i64> = arrival
            .iter()
            .map(|&i| i64::try_from(i).unwrap_or(-1))
            .collect();
        comm.broadcast(&mut order, 0)?;
        let order: Vec<usize> = order
            .iter()
            .map(|&i| usize::try_from(i).unwrap_or(usize::MAX))
            .collect();
        let mut seen = vec![false; self.sizes.len()];
        for &i in &order {
            if i >= seen.len() || std::mem::replace(&mut seen[i], true) {
                return Err(Error::peer(
                    0,
                    "broadcast a fusion order that is not a permutation",
                ));
            }
        }
        let placed = placement::<T>(&self.sizes, &order, self.buffer_elements)?;
        self.buffers = zeroed_buffers(&placed.plan);
        self.placed = Some(placed);
        Ok(())
    }
}

/// The placement of tensors of `sizes` elements taken in `order`.
fn placement<T: Element>(
    sizes: &[usize],
    order: &[usize],
    buffer_elements: usize,
) -> Result<Placement> {
    let size = std::mem::size_of::<T>() as u64;
    let ordered: Vec<u64> = order.iter().map(|&i| sizes[i] as u64 * size).collect();
    let mut ordered_positions = vec![Position::default(); order.len()];
    let plan = plan_fusion(
        &ordered,
        buffer_elements as u64 * size,
        size,
        &mut ordered_positions,
    )
    .map_err(|e| Error::invalid("tensors", e.to_string()))?;
    let mut positions = vec![Position::default(); sizes.len()];
    for (k, &i) in order.iter().enumerate() {
        positions[i] = ordered_positions[k];
    }
    let buffers = plan.buffers() as usize;
    let mut members = vec![0usize; buffers];
    let mut touches = vec![0..0; sizes.len()];
    for (i, &n) in sizes.iter().enumerate() {
        let mut pieces = plan
            .pieces(positions[i], n as u64 * size)
            .map(|p| p.buffer as usize);
        if let Some(first) = pieces.next() {
            let last = pieces.last().unwrap_or(first);
            touches[i] = first..last + 1;
            for m in &mut members[first..=last] {
                *m += 1;
            }
        }
    }
    Ok(Placement {
        plan,
        positions,
        members,
        touches,
    })
}

/// The buffers of `plan`, zeroed.
fn zeroed_buffers<T: Element>(plan: &FusionPlan) -> Vec<Vec<T>> {
    let size = std::mem::size_of::<T>() as u64;
    (0..plan.buffers())
        .map(|b| vec![<T as bytemuck::Zeroable>::zeroed(); (plan.buffer_len(b) / size) as usize])
        .collect()
}

/// Holds tensor `index` until the step ends, if it is one of the set, of its
/// declared length, and not handed over before.
fn hold<'t, T>(
    sizes: &[usize],
    held: &mut [Option<&'t mut [T]>],
    index: usize,
    t: &'t mut [T],
) -> Result<()> {
    if index >= sizes.len() || held[index].is_some() || t.len() != sizes[index] {
        return Err(bad_tensor(index, t.len(), sizes));
    }
    held[index] = Some(t);
    Ok(())
}

fn bad_tensor(index: usize, len: usize, sizes: &[usize]) -> Error {
    let reason = match sizes.get(index) {
        None => format!(
            "index {index} is not below the {} tensors of the set",
            sizes.len()
        ),
        Some(&n) if n != len => format!("tensor {index} has {len} elements, declared {n}"),
        Some(_) => format!("tensor {index} was handed over twice"),
    };
    Error::invalid("tensors", reason)
}

/// Tensor `index` (of `n` elements) is in: copies it into its buffers and counts
/// it there.
fn arrived<T: Element>(
    p: &Placement,
    n: usize,
    index: usize,
    t: &[T],
    buffers: &mut [Option<&mut [T]>],
    waiting: &mut [usize],
) {
    copy_in(p, n, index, t, buffers);
    for b in p.touches[index].clone() {
        waiting[b] -= 1;
    }
}

fn copy_in<T: Element>(
    p: &Placement,
    n: usize,
    index: usize,
    t: &[T],
    buffers: &mut [Option<&mut [T]>],
) {
    let size = std::mem::size_of::<T>() as u64;
    for piece in p.plan.pieces(p.positions[index], n as u64 * size) {
        let (at, from, len) = (
            (piece.offset / size) as usize,
            (piece.tensor_offset / size) as usize,
            (piece.len / size) as usize,
        );
        if let Some(Some(buf)) = buffers.get_mut(piece.buffer as usize) {
            buf[at..at + len].copy_from_slice(&t[from..from + len]);
        }
    }
}

fn copy_out<T: Element>(p: &Placement, index: usize, t: &mut [T], buffers: &[Vec<T>]) {
    let size = std::mem::size_of::<T>() as u64;
    for piece in p.plan.pieces(p.positions[index], t.len() as u64 * size) {
        let (at, to, len) = (
            (piece.offset / size) as usize,
            (piece.tensor_offset / size) as usize,
            (piece.len / size) as usize,
        );
        t[to..to + len].copy_from_slice(&buffers[piece.buffer as usize][at..at + len]);
    }
}

/// All-reduces `tensors` through fusion buffers of `buffer_bytes` placed in list
/// order (the same on every rank: no order needs broadcasting).
pub(crate) fn all_reduce_list<T: Element>(
    comm: &Communicator,
    tensors: &mut [&mut [T]],
    op: ReduceOp,
    buffer_bytes: usize,
) -> Result<()> {
    let sizes: Vec<usize> = tensors.iter().map(|t| t.len()).collect();
    let order: Vec<usize> = (0..sizes.len()).collect();
    let mut fusion = Fusion::<T>::new(&sizes, buffer_bytes)?;
    let placed = placement::<T>(&sizes, &order, fusion.buffer_elements)?;
    fusion.buffers = zeroed_buffers(&placed.plan);
    fusion.placed = Some(placed);
    fusion.all_reduce(
        comm,
        tensors.iter_mut().enumerate().map(|(i, t)| (i, &mut **t)),
        op,
    )
}
