//! Rendezvous: a small key-value store every rank of a job can reach.
//!
//! The engine uses it while a communicator is built (host identities, fabric
//! endpoints, region descriptors), and afterwards only to link a peer a
//! message first names (its endpoint, `bootstrap::late_links`). [`Store`] is deliberately small and synchronous so
//! that a host runtime can implement it over its own store through a C ABI (PyTorch
//! passes its `c10d::Store`). The default is [`TcpStore`]: served by rank 0 at
//! `MASTER_ADDR:MASTER_PORT`, admitting only clients that prove they know the job
//! secret, with bounded key and value sizes. Under torchrun, whose agent already
//! serves PyTorch's TCPStore on that port, ranks use [`C10dStore`] instead.

mod c10d;
#[cfg(test)]
pub(crate) mod in_process;
mod protocol;
pub(crate) mod tcp;

use std::time::{Duration, Instant};

use crate::error::{Error, Result};
pub use c10d::C10dStore;
pub use tcp::{TcpStore, TcpStoreServer};

/// Longest key a store must accept, in bytes.
pub const MAX_KEY_LEN: usize = 1024;
/// Largest value a store must accept, in bytes.
pub const MAX_VALUE_LEN: usize = 1 << 20;

/// A key-value store shared by the ranks of a job.
pub trait Store: Send + Sync {
    /// Sets `key` to `value`, replacing any earlier value.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;

    /// The value of `key`, waiting up to `timeout` for some rank to set it.
    /// Fails with [`Error::Timeout`] naming the key if none does.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;

    /// Whether every key in `keys` is set, without waiting.
    fn check(&self, keys: &[&str]) -> Result<bool>;
}

/// The values of every key in `keys`, waiting up to `timeout` in all. On timeout
/// the error lists every key still missing, not only the first.
pub fn gather(store: &dyn Store, keys: &[String], timeout: Duration) -> Result<Vec<Vec<u8>>> {
    let deadline = Instant::now() + timeout;
    let mut values = Vec::with_capacity(keys.len());
    for (i, key) in keys.iter().enumerate() {
        let left = deadline.saturating_duration_since(Instant::now());
        match store.get(key, left) {
            Ok(v) => values.push(v),
            Err(Error::Timeout { .. }) => {
                let mut missing = Vec::new();
                for k in &keys[i..] {
                    if !store.check(&[k.as_str()])? {
                        missing.push(k.as_str());
                    }
                }
                return Err(Error::timeout(
                    format!("rendezvous keys {}", missing.join(", ")),
                    timeout,
                ));
            }
            Err(e) => return Err(e),
        }
    }
    Ok(values)
}

/// A view of a store in which every key is prefixed with `prefix/`: one store can
/// serve several communicators (or several uses) without collisions.
pub struct PrefixStore<S> {
    prefix: String,
    inner: S,
}

impl<S: Store> PrefixStore<S> {
    /// A view of `inner` under `prefix`.
    pub fn new(prefix: impl Into<String>, inner: S) -> PrefixStore<S> {
        PrefixStore {
            prefix: prefix.into(),
            inner,
        }
    }

    fn key(&self, key: &str) -> String {
        format!("{}/{key}", self.prefix)
    }
}

impl<S: Store> Store for PrefixStore<S> {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(&self.key(key), value)
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.inner.get(&self.key(key), timeout)
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        let owned: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let refs: Vec<&str> = owned.iter().map(String::as_str).collect();
        self.inner.check(&refs)
    }
}

impl<S: Store + ?Sized> Store for &S {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        (**self).set(key, value)
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        (**self).get(key, timeout)
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        (**self).check(keys)
    }
}

impl<S: Store + ?Sized> Store for std::sync::Arc<S> {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        (**self).set(key, value)
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        (**self).get(key, timeout)
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        (**self).check(keys)
    }
}
