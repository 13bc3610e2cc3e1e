//! The all-to-all: block `j` of every rank's input to rank `j`, each block
//! moved once, as one message to its rank (this rank's own block is
//! copied): a group of sends and receives under one [`Work`], posted from
//! the pool's lists, so that a warm all-to-all allocates nothing.

use fairring_core::DataType;
use fairring_core::reduce::Element;

use super::Message;
use crate::communicator::{Communicator, Covers, Work, check_pointer};
use crate::error::{Error, Result};

impl Communicator {
    /// Sends block `j` of `input` to rank `j` and receives block `j` of
    /// `output` from rank `j`, blocks of equal length (`input.len() /
    /// world_size`), and waits. `input` is borrowed mutably for the same
    /// reason as [`Communicator::send`]'s data; its contents are unchanged.
    pub fn all_to_all<T: Element>(&self, input: &mut [T], output: &mut [T]) -> Result<()> {
        let world = self.world_size() as usize;
        if !input.len().is_multiple_of(world) {
            return Err(Error::invalid(
                "input",
                format!(
                    "{} elements do not split equally among {world} ranks",
                    input.len()
                ),
            ));
        }
        if output.len() != input.len() {
            return Err(Error::invalid(
                "output",
                format!(
                    "holds {} elements where the input holds {}",
                    output.len(),
                    input.len()
                ),
            ));
        }
        let counts = vec![(input.len() / world) as u64; world];
        self.all_to_all_v(input, &counts, output, &counts)
    }

    /// Sends `input_counts[j]` elements of `input` (the blocks in rank order)
    /// to rank `j` and receives `output_counts[j]` elements of `output` from
    /// it, and waits. Rank `j`'s `input_counts[i]` must equal rank `i`'s
    /// `output_counts[j]`: a block of another length fails both ranks with a
    /// [`Error::Mismatch`] naming both.
    pub fn all_to_all_v<T: Element>(
        &self,
        input: &mut [T],
        input_counts: &[u64],
        output: &mut [T],
        output_counts: &[u64],
    ) -> Result<()> {
        check_total("input_counts", input_counts, input.len())?;
        check_total("output_counts", output_counts, output.len())?;
        let (i, o) = (input.as_mut_ptr().cast(), output.as_mut_ptr().cast());
        // SAFETY: both buffers are borrowed mutably (so apart) until the
        // messages have finished (`wait`, or the drop that waits); their
        // lengths match the counts, checked above.
        unsafe { self.post_all_to_all(i, input_counts, o, output_counts, T::DTYPE) }?.wait()
    }

    /// Posts an all-to-all of `dtype` elements (see
    /// [`Communicator::all_to_all_v`]) and returns at once: this rank's own
    /// block is copied before it returns, every other one is a message in
    /// flight (or waiting at the gate).
    ///
    /// # Safety
    ///
    /// `input` and `output` must be valid for reads and writes of the sums
    /// of `input_counts` and `output_counts` elements, aligned for `dtype`,
    /// apart from each other, and not written (`output` not read either) by
    /// anything else until the [`Work`] reports completion (or is dropped,
    /// which waits).
    pub unsafe fn post_all_to_all(
        &self,
        input: *mut u8,
        input_counts: &[u64],
        output: *mut u8,
        output_counts: &[u64],
        dtype: DataType,
    ) -> Result<Work<'_>> {
        let world = self.world_size();
        let me = self.rank() as usize;
        let in_bytes = bytes("input_counts", input_counts, world, dtype)?;
        let out_bytes = bytes("output_counts", output_counts, world, dtype)?;
        check_pointer(input, u64::from(in_bytes > 0), dtype)?;
        check_pointer(output, u64::from(out_bytes > 0), dtype)?;
        let (a, b) = (input as usize, output as usize);
        if in_bytes > 0
            && out_bytes > 0
            && a < b.saturating_add(out_bytes)
            && b < a.saturating_add(in_bytes)
        {
            return Err(Error::invalid(
                "output",
                format!("{output:p} overlaps the input ({input:p}, {in_bytes} bytes)"),
            ));
        }
        if input_counts[me] != output_counts[me] {
            return Err(Error::invalid(
                "output_counts",
                format!(
                    "this rank's block to itself ({} elements) does not fit its place in the \
                     output ({} elements)",
                    input_counts[me], output_counts[me]
                ),
            ));
        }
        // Every count was checked to fit in memory (`bytes`): the products
        // and sums below cannot overflow.
        let size = dtype.size_bytes();
        let offset = |counts: &[u64], j: usize| -> usize {
            let elements: u64 = counts[..j].iter().sum();
            usize::try_from(elements * size).unwrap_or(usize::MAX)
        };
        let own = usize::try_from(input_counts[me] * size).unwrap_or(0);
        // SAFETY: both ranges lie inside the caller's buffers (their lengths
        // are the counts' sums), which are apart; nothing else writes them.
        unsafe {
            std::ptr::copy_nonoverlapping(
                input.wrapping_add(offset(input_counts, me)),
                output.wrapping_add(offset(output_counts, me)),
                own,
            );
        }
        let mut posted = self.posted_list(2 * (world as usize).saturating_sub(1));
        let (mut at_in, mut at_out) = (0usize, 0usize);
        for peer in 0..world {
            let j = peer as usize;
            let (send, receive) = (input_counts[j], output_counts[j]);
            if j != me {
                for (sending, count, base, at) in
                    [(true, send, input, at_in), (false, receive, output, at_out)]
                {
                    // SAFETY: the block lies inside the caller's buffer, whose
                    // contract covers it until the messages finish (dropping
                    // them waits for those posted so far if a post fails).
                    let one = unsafe {
                        self.post_one(peer, sending, 0, base.wrapping_add(at), count, dtype)
                    };
                    match one {
                        Ok(p) => posted.push(p),
                        Err(e) => {
                            drop(Message::many(posted, &self.p2p.pool));
                            return Err(e);
                        }
                    }
                }
            }
            at_in += usize::try_from(send * size).unwrap_or(0);
            at_out += usize::try_from(receive * size).unwrap_or(0);
        }
        let mut covers = Covers::nothing();
        covers.messages = Some(Message::many(posted, &self.p2p.pool));
        Ok(Work::new(&self.engine, covers))
    }
}

/// Refuses counts whose sum is not `len`, naming `argument`.
fn check_total(argument: &'static str, counts: &[u64], len: usize) -> Result<()> {
    let total = counts.iter().try_fold(0u64, |a, &c| a.checked_add(c));
    if total != Some(len as u64) {
        return Err(Error::invalid(
            argument,
            format!("{counts:?} do not add up to the buffer's {len} elements"),
        ));
    }
    Ok(())
}

/// The bytes `counts` of `dtype` elements span; refused (naming
/// `argument`) unless there is one count per rank of `world` and every
/// partial sum of bytes is addressable.
fn bytes(argument: &'static str, counts: &[u64], world: u32, dtype: DataType) -> Result<usize> {
    if counts.len() != world as usize {
        return Err(Error::invalid(
            argument,
            format!("holds {} counts for {world} ranks", counts.len()),
        ));
    }
    counts
        .iter()
        .try_fold(0usize, |at, &c| {
            c.checked_mul(dtype.size_bytes())
                .and_then(|b| usize::try_from(b).ok())
                .and_then(|b| at.checked_add(b))
                .filter(|&end| end <= isize::MAX as usize)
        })
        .ok_or_else(|| {
            Error::invalid(
                argument,
                format!("{counts:?} elements of {dtype} do not fit in memory"),
            )
        })
}
