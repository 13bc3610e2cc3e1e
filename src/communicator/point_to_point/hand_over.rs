//! Handing messages to the engine once they may start: one post at a
//! time ([`post_one`]), or the list of one call's ([`GatedPosts`],
//! [`hand_over_list`]), which the gate and a chain hold until then.

use std::sync::Arc;

use super::{PointToPoint, Posted};
use crate::communicator::Call;
use crate::error::{Error, Result};

/// The messages of one call, each its memory (as a call) and its post.
pub(super) struct GatedPosts(pub(super) Vec<(Call, Arc<Posted>)>);

// SAFETY: the calls' pointers are the caller's memory, which the contract of
// `Communicator::start` keeps valid and unshared until the call's work
// reports completion; the gate thread only hands them to the engine, as the
// calling thread would have. An emptied list holds none.
unsafe impl Send for GatedPosts {}

/// Starts `call` as the message `posted` describes, or fails it if the
/// communicator closed.
///
/// # Safety
///
/// `call`'s memory must stay valid and unshared until `posted` reports
/// completion.
pub(super) unsafe fn post_one(p2p: Option<&Arc<PointToPoint>>, call: Call, posted: Arc<Posted>) {
    match p2p {
        // SAFETY: forwarded.
        Some(c) => unsafe { c.start(call, posted) },
        None => posted.settle(Err(closed())),
    }
}

/// Starts each of `posts`, or fails it with the check's error.
/// The list goes to `give_back` before its last post is settled: the caller,
/// who may issue the next call as soon as every post has finished, then
/// finds it free.
pub(super) fn hand_over_list(
    mut posts: GatedPosts,
    outcome: &Result<()>,
    p2p: Option<&Arc<PointToPoint>>,
    give_back: &mut dyn FnMut(GatedPosts),
) {
    while let Some((call, posted)) = posts.0.pop() {
        if posts.0.is_empty() {
            give_back(std::mem::replace(&mut posts, GatedPosts(Vec::new())));
        }
        match outcome {
            // SAFETY: the call's memory is the caller's until the post
            // reports completion (`GatedPosts`' SAFETY note).
            Ok(()) => unsafe { post_one(p2p, call, posted) },
            Err(e) => posted.settle(Err(e.clone())),
        }
    }
}

/// The error of a post that can no longer start: the communicator closed.
pub(super) fn closed() -> Error {
    Error::invalid("comm", "the communicator was closed")
}
