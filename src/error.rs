//! The engine's one error type.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use fairring_rdma::fabric::FabricError;

/// Why a communicator call failed.
///
/// Errors are cheap to clone (the rare large parts are shared), because one failure
/// reaches every operation in flight.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum Error {
    /// A configuration value (an environment variable or a builder field) is invalid.
    Config {
        /// The variable or field, e.g. `FAIRRING_TOTAL_MEMORY`.
        variable: &'static str,
        /// The value given.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An argument of a call is invalid; nothing was done.
    InvalidArgument {
        /// The argument.
        argument: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The rendezvous store failed or refused a request.
    Store {
        /// What was being done.
        operation: &'static str,
        /// What went wrong.
        reason: String,
    },
    /// The ranks do not form a job this engine can run (for instance machines with
    /// different numbers of ranks).
    Topology {
        /// What is wrong.
        reason: String,
    },
    /// Something did not happen in time.
    Timeout {
        /// What was waited for.
        what: String,
        /// How long was waited.
        after: Duration,
    },
    /// A peer failed or broke the protocol.
    Peer {
        /// The peer's rank.
        rank: u32,
        /// What happened.
        reason: String,
    },
    /// The fabric failed.
    Fabric(Arc<FabricError>),
    /// An operating-system call failed.
    Io {
        /// What was being done.
        context: String,
        /// The error.
        source: Arc<std::io::Error>,
    },
    /// Ranks issued different operations under one sequence number (sizes, types,
    /// operators, collectives or algorithms differ, or a rank skipped a call).
    /// Nothing of that operation or any later one was combined.
    Mismatch {
        /// The operation's sequence number (the same count of calls on every rank).
        sequence: u64,
        /// One rank, and what it called.
        rank: u32,
        /// What `rank` called, e.g. `all_reduce of 1024 x f32 (sum, hierarchical)`.
        called: String,
        /// Another rank, and what it called.
        peer: u32,
        /// What `peer` called.
        peer_called: String,
    },
    /// The engine found one of its own invariants broken: a bug in fairring, not a
    /// fault of the call, the configuration or a peer. The communicator has failed.
    Internal {
        /// The invariant, as a statement that should have held (e.g. `a slice
        /// releases its buffer after its last step`).
        invariant: &'static str,
        /// What was found instead.
        detail: String,
    },
    /// A CUDA driver call on a device tensor's behalf failed, or the GPU layer
    /// refused it (the `cuda` feature): the GPU layer's words, naming the call.
    Gpu(String),
    /// The communicator was aborted.
    Aborted,
    /// The communicator failed earlier and refuses new work.
    Failed {
        /// The first error.
        first: Box<Error>,
    },
}

impl Error {
    pub(crate) fn config(
        variable: &'static str,
        value: impl fmt::Display,
        reason: impl Into<String>,
    ) -> Error {
        Error::Config {
            variable,
            value: value.to_string(),
            reason: reason.into(),
        }
    }

    pub(crate) fn invalid(argument: &'static str, reason: impl Into<String>) -> Error {
        Error::InvalidArgument {
            argument,
            reason: reason.into(),
        }
    }

    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Error {
        Error::Io {
            context: context.into(),
            source: Arc::new(source),
        }
    }

    pub(crate) fn store(operation: &'static str, reason: impl Into<String>) -> Error {
        Error::Store {
            operation,
            reason: reason.into(),
        }
    }

    pub(crate) fn timeout(what: impl Into<String>, after: Duration) -> Error {
        Error::Timeout {
            what: what.into(),
            after,
        }
    }

    pub(crate) fn internal(invariant: &'static str, detail: impl Into<String>) -> Error {
        Error::Internal {
            invariant,
            detail: detail.into(),
        }
    }

    pub(crate) fn peer(rank: u32, reason: impl Into<String>) -> Error {
        Error::Peer {
            rank,
            reason: reason.into(),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Config {
                variable,
                value,
                reason,
            } => write!(f, "invalid {variable}={value:?}: {reason}"),
            Error::InvalidArgument { argument, reason } => {
                write!(f, "invalid argument `{argument}`: {reason}")
            }
            Error::Store { operation, reason } => {
                write!(f, "rendezvous store: {operation} failed: {reason}")
            }
            Error::Topology { reason } => write!(f, "unsupported job layout: {reason}"),
            Error::Timeout { what, after } => {
                write!(f, "timed out after {after:?} waiting for {what}")
            }
            Error::Peer { rank, reason } => write!(f, "rank {rank}: {reason}"),
            Error::Fabric(e) => write!(f, "fabric: {e}"),
            Error::Gpu(reason) => write!(f, "GPU: {reason}"),
            Error::Io { context, source } => write!(f, "{context}: {source}"),
            Error::Mismatch {
                sequence,
                rank,
                called,
                peer,
                peer_called,
            } => write!(
                f,
                "operation #{sequence} differs across ranks: rank {rank} called {called}, \
                 rank {peer} called {peer_called}"
            ),
            Error::Internal { invariant, detail } => write!(
                f,
                "internal error, a bug in fairring: expected that {invariant}, found {detail}"
            ),
            Error::Aborted => f.write_str("the communicator was aborted"),
            Error::Failed { first } => {
                write!(
                    f,
                    "the communicator failed earlier and takes no new work: {first}"
                )
            }
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Fabric(e) => Some(&**e),
            Error::Io { source, .. } => Some(&**source),
            Error::Failed { first } => Some(&**first),
            _ => None,
        }
    }
}

impl From<FabricError> for Error {
    fn from(e: FabricError) -> Error {
        match e {
            FabricError::PeerFailed { peer, failure } => Error::peer(peer, failure.to_string()),
            other => Error::Fabric(Arc::new(other)),
        }
    }
}

/// Shorthand for this crate's results.
pub type Result<T, E = Error> = std::result::Result<T, E>;
