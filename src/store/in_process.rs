//! (tests) A store in memory, for ranks that are threads of one test; it can
//! rewrite what a rank publishes under one key (`forge`).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::Store;
use crate::error::{Error, Result};

/// A store in memory; `forge` rewrites what is set under its key.
#[derive(Default)]
pub(crate) struct InProcessStore {
    values: Mutex<HashMap<String, Vec<u8>>>,
    forge: Option<(String, Vec<u8>)>,
}

impl InProcessStore {
    /// A store that sets `instead` whenever a rank sets `key`.
    pub(crate) fn forging(key: &str, instead: Vec<u8>) -> InProcessStore {
        InProcessStore {
            values: Mutex::default(),
            forge: Some((key.to_owned(), instead)),
        }
    }
}

impl Store for InProcessStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let value = match &self.forge {
            Some((forged, instead)) if forged == key => instead.clone(),
            _ => value.to_vec(),
        };
        self.values
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(key.to_owned(), value);
        Ok(())
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let end = Instant::now() + timeout;
        loop {
            let values = self
                .values
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some(v) = values.get(key) {
                return Ok(v.clone());
            }
            drop(values);
            if Instant::now() > end {
                return Err(Error::timeout(key, timeout));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        let values = self
            .values
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Ok(keys.iter().all(|k| values.contains_key(*k)))
    }
}
