//! A communicator made through `fr_comm_with_store`, with a store written here
//! as C callbacks: two ranks on two threads of this process.

use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use fairring_ffi::*;

#[derive(Default)]
struct Table {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
    released: AtomicUsize,
}

/// # Safety
/// `user` is a `Table`; `key` is NUL-terminated.
unsafe fn key_of<'a>(user: *mut c_void, key: *const c_char) -> (&'a Table, String) {
    // SAFETY: per the function's contract.
    let table = unsafe { &*user.cast::<Table>() };
    // SAFETY: per the function's contract.
    let key = unsafe { CStr::from_ptr(key) }
        .to_string_lossy()
        .into_owned();
    (table, key)
}

unsafe extern "C" fn set(user: *mut c_void, key: *const c_char, v: *const u8, len: usize) -> i32 {
    // SAFETY: fairring passes our `user` and a NUL-terminated key.
    let (table, key) = unsafe { key_of(user, key) };
    // SAFETY: `v` spans `len` bytes for the call.
    let value = unsafe { std::slice::from_raw_parts(v, len) }.to_vec();
    table.map.lock().unwrap().insert(key, value);
    table.changed.notify_all();
    FR_STORE_OK
}

unsafe extern "C" fn get(
    user: *mut c_void,
    key: *const c_char,
    timeout_ms: u64,
    value: *mut u8,
    capacity: usize,
    len: *mut usize,
) -> i32 {
    // SAFETY: fairring passes our `user` and a NUL-terminated key.
    let (table, key) = unsafe { key_of(user, key) };
    let map = table.map.lock().unwrap();
    let (map, _) = table
        .changed
        .wait_timeout_while(map, Duration::from_millis(timeout_ms), |m| {
            !m.contains_key(&key)
        })
        .unwrap();
    let Some(v) = map.get(&key) else {
        return FR_STORE_TIMEOUT;
    };
    if v.len() > capacity {
        return 7;
    }
    // SAFETY: `value` has room for `capacity >= v.len()` bytes.
    unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), value, v.len()) };
    // SAFETY: `len` is valid for a write.
    unsafe { len.write(v.len()) };
    FR_STORE_OK
}

unsafe extern "C" fn check(
    user: *mut c_void,
    keys: *const *const c_char,
    count: usize,
    ready: *mut bool,
) -> i32 {
    // SAFETY: fairring passes our `user`.
    let table = unsafe { &*user.cast::<Table>() };
    let map = table.map.lock().unwrap();
    // SAFETY: `keys` holds `count` NUL-terminated keys.
    let keys = unsafe { std::slice::from_raw_parts(keys, count) };
    let all = keys.iter().all(|&k| {
        // SAFETY: each is NUL-terminated.
        let k = unsafe { CStr::from_ptr(k) }.to_string_lossy();
        map.contains_key(k.as_ref())
    });
    // SAFETY: `ready` is valid for a write.
    unsafe { ready.write(all) };
    FR_STORE_OK
}

unsafe extern "C" fn release(user: *mut c_void) {
    // SAFETY: fairring passes our `user`.
    let table = unsafe { &*user.cast::<Table>() };
    table.released.fetch_add(1, Ordering::SeqCst);
}

fn store(table: &Table) -> fr_store {
    fr_store {
        user: std::ptr::from_ref(table).cast_mut().cast(),
        set: Some(set),
        get: Some(get),
        check: Some(check),
        release: Some(release),
    }
}

fn last_error() -> String {
    // SAFETY: never null, NUL-terminated.
    unsafe { CStr::from_ptr(fr_last_error()) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn two_ranks_meet_through_callbacks_and_all_reduce() {
    let table = Table::default();
    let results: Vec<Vec<f64>> = std::thread::scope(|s| {
        let ranks: Vec<_> = (0..2u32)
            .map(|rank| {
                let table = &table;
                s.spawn(move || {
                    let st = store(table);
                    let mut comm: *mut fr_comm = std::ptr::null_mut();
                    // SAFETY: `st` outlives the call; `comm` is a valid place.
                    let status = unsafe { fr_comm_with_store(rank, 2, &st, 20_000, &mut comm) };
                    assert_eq!(status, FR_OK, "rank {rank}: {}", last_error());
                    let mut data: Vec<f64> = (0..5000)
                        .map(|i| f64::from(i) * f64::from(rank + 1))
                        .collect();
                    let mut work: *mut fr_work = std::ptr::null_mut();
                    // SAFETY: `data` is valid and untouched until the wait below.
                    let status = unsafe {
                        fr_all_reduce(
                            comm,
                            data.as_mut_ptr().cast(),
                            5000,
                            FR_DTYPE_F64,
                            FR_OP_AVG,
                            &mut work,
                        )
                    };
                    assert_eq!(status, FR_OK, "rank {rank}: {}", last_error());
                    // SAFETY: a live handle.
                    let status = unsafe { fr_work_wait(work) };
                    assert_eq!(status, FR_OK, "rank {rank}: {}", last_error());
                    // SAFETY: a live handle, freed once.
                    unsafe { fr_work_free(work) };
                    // SAFETY: a live handle, destroyed once.
                    unsafe { fr_comm_destroy(comm) };
                    data
                })
            })
            .collect();
        ranks.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for data in results {
        for (i, x) in data.iter().enumerate() {
            assert_eq!(*x, i as f64 * 1.5);
        }
    }
    // Each communicator let go of its copy of the store once.
    assert_eq!(table.released.load(Ordering::SeqCst), 2);
}

#[test]
fn a_store_without_a_required_callback_is_refused_and_released() {
    let table = Table::default();
    let mut st = store(&table);
    st.check = None;
    let mut comm: *mut fr_comm = std::ptr::null_mut();
    // SAFETY: `st` outlives the call; `comm` is a valid place.
    let status = unsafe { fr_comm_with_store(0, 1, &st, 0, &mut comm) };
    assert_eq!(status, FR_INVALID_ARGUMENT);
    assert!(last_error().contains("check is null"), "{}", last_error());
    assert!(comm.is_null());
    assert_eq!(table.released.load(Ordering::SeqCst), 1);
}

#[test]
fn a_key_that_never_comes_times_out_naming_it() {
    // Rank 1 of 2 alone: rank 0 never writes its keys.
    let table = Table::default();
    let st = store(&table);
    let mut comm: *mut fr_comm = std::ptr::null_mut();
    // SAFETY: `st` outlives the call; `comm` is a valid place.
    let status = unsafe { fr_comm_with_store(1, 2, &st, 500, &mut comm) };
    assert_eq!(status, FR_TIMEOUT, "{}", last_error());
    assert!(last_error().contains("rank(s) 0 of 2"), "{}", last_error());
    assert!(comm.is_null());
    assert_eq!(table.released.load(Ordering::SeqCst), 1);
}
