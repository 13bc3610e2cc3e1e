//! A rendezvous store the host runtime provides as callbacks (PyTorch passes
//! its `c10d::Store` this way).

use std::ffi::{CString, c_char, c_void};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use fairring::store::MAX_VALUE_LEN;
use fairring::{Error, Result, Store};

/// What a store callback returns: `FR_STORE_OK`, `FR_STORE_TIMEOUT`, or any
/// other value for a failure.
pub type fr_store_status = i32;
/// The callback succeeded.
pub const FR_STORE_OK: fr_store_status = 0;
/// `get`: the key was not set within the timeout.
pub const FR_STORE_TIMEOUT: fr_store_status = 1;

/// Sets `key` (NUL-terminated UTF-8) to the `len` bytes at `value`.
pub type fr_store_set_fn = Option<
    unsafe extern "C" fn(
        user: *mut c_void,
        key: *const c_char,
        value: *const u8,
        len: usize,
    ) -> fr_store_status,
>;

/// Waits up to `timeout_ms` for `key` to be set, then writes its value into
/// `value` (room for `capacity` bytes) and its length into `*len`. A value
/// longer than `capacity` is a failure.
pub type fr_store_get_fn = Option<
    unsafe extern "C" fn(
        user: *mut c_void,
        key: *const c_char,
        timeout_ms: u64,
        value: *mut u8,
        capacity: usize,
        len: *mut usize,
    ) -> fr_store_status,
>;

/// Writes into `*ready` whether each of the `count` keys is set, without
/// waiting.
pub type fr_store_check_fn = Option<
    unsafe extern "C" fn(
        user: *mut c_void,
        keys: *const *const c_char,
        count: usize,
        ready: *mut bool,
    ) -> fr_store_status,
>;

/// Called once when the communicator no longer needs the store.
pub type fr_store_release_fn = Option<unsafe extern "C" fn(user: *mut c_void)>;

/// A store given as callbacks. fairring calls them one at a time, from the
/// thread that builds the communicator or from its own threads, until it calls
/// `release` (which may be null); `set`, `get` and `check` must not be null.
///
/// fairring writes each key once and reads it with a timeout, so a store needs
/// no `add` or `compare_set`. Keys are at most 1024 bytes, values at most 1 MiB.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct fr_store {
    /// Passed to every callback.
    pub user: *mut c_void,
    /// Required.
    pub set: fr_store_set_fn,
    /// Required.
    pub get: fr_store_get_fn,
    /// Required.
    pub check: fr_store_check_fn,
    /// Optional.
    pub release: fr_store_release_fn,
}

/// [`fr_store`] as a [`Store`].
pub(crate) struct CallbackStore {
    callbacks: Mutex<fr_store>,
}

// SAFETY: the caller of `fr_comm_with_store` promises that the callbacks may be
// called from any thread, one at a time; the mutex makes it one at a time.
unsafe impl Send for CallbackStore {}
// SAFETY: as for `Send`: every use goes through the mutex.
unsafe impl Sync for CallbackStore {}

impl CallbackStore {
    /// Checks that the required callbacks are present.
    pub(crate) fn new(callbacks: fr_store) -> std::result::Result<CallbackStore, &'static str> {
        if callbacks.set.is_none() {
            return Err("set is null");
        }
        if callbacks.get.is_none() {
            return Err("get is null");
        }
        if callbacks.check.is_none() {
            return Err("check is null");
        }
        Ok(CallbackStore {
            callbacks: Mutex::new(callbacks),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, fr_store> {
        self.callbacks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

fn c_key(key: &str) -> Result<CString> {
    CString::new(key).map_err(|_| store_error("key", format!("{key:?} contains a NUL byte")))
}

fn store_error(operation: &'static str, reason: String) -> Error {
    Error::Store {
        operation,
        reason: format!("the host store's callback: {reason}"),
    }
}

impl Store for CallbackStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let k = c_key(key)?;
        let s = self.lock();
        let Some(set) = s.set else {
            return Err(store_error("set", "no callback".into()));
        };
        // SAFETY: `k` is NUL-terminated and `value` spans `len` bytes, both for
        // the call; the callback's own contract is the caller's.
        let status = unsafe { set(s.user, k.as_ptr(), value.as_ptr(), value.len()) };
        match status {
            FR_STORE_OK => Ok(()),
            other => Err(store_error("set", format!("of {key} returned {other}"))),
        }
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let k = c_key(key)?;
        let mut value = vec![0u8; MAX_VALUE_LEN];
        let mut len = 0usize;
        let s = self.lock();
        let Some(get) = s.get else {
            return Err(store_error("get", "no callback".into()));
        };
        let ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        // SAFETY: `k` is NUL-terminated; `value` has room for `capacity` bytes
        // and `len` is a valid place for the length, both for the call.
        let status = unsafe {
            get(
                s.user,
                k.as_ptr(),
                ms,
                value.as_mut_ptr(),
                value.len(),
                &raw mut len,
            )
        };
        match status {
            FR_STORE_OK if len <= value.len() => {
                value.truncate(len);
                Ok(value)
            }
            FR_STORE_OK => Err(store_error(
                "get",
                format!("of {key} reported {len} bytes, over the {MAX_VALUE_LEN}-byte room"),
            )),
            FR_STORE_TIMEOUT => Err(Error::Timeout {
                what: format!("rendezvous key {key} in the host store"),
                after: timeout,
            }),
            other => Err(store_error("get", format!("of {key} returned {other}"))),
        }
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        let owned = keys.iter().map(|k| c_key(k)).collect::<Result<Vec<_>>>()?;
        let pointers: Vec<*const c_char> = owned.iter().map(|k| k.as_ptr()).collect();
        let mut ready = false;
        let s = self.lock();
        let Some(check) = s.check else {
            return Err(store_error("check", "no callback".into()));
        };
        // SAFETY: `pointers` holds `count` NUL-terminated keys alive for the
        // call; `ready` is a valid place.
        let status = unsafe { check(s.user, pointers.as_ptr(), pointers.len(), &raw mut ready) };
        match status {
            FR_STORE_OK => Ok(ready),
            other => Err(store_error("check", format!("returned {other}"))),
        }
    }
}

impl Drop for CallbackStore {
    fn drop(&mut self) {
        let s = self.lock();
        if let Some(release) = s.release {
            // SAFETY: called once, after the last use of the callbacks.
            unsafe { release(s.user) };
        }
    }
}
