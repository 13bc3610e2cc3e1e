//! The GPU half of a fairring machine.
//!
//! This crate will bind [`fairring_core`] to CUDA through cudarc (driver, NCCL and
//! NVRTC, loaded at run time so that it builds and tests with no CUDA installed):
//!
//! - an availability probe that never panics and names what is missing;
//! - contexts, streams and events, device and pinned host buffers, and raw-pointer
//!   views of memory owned by a host runtime (PyTorch hands over a pointer and a
//!   stream);
//! - NCCL reduce-scatter and all-gather among the devices of one machine, in place;
//! - the device reduction kernel (`dst op= src`) for the dtypes and ops of
//!   [`fairring_core::reduce`];
//! - the staging pool: one stream per pipeline stage with events between them, sized
//!   by [`fairring_core::plan::StagingLayout`], so that completion of an all-reduce is
//!   an event a caller can chain GPU work after.
//!
//! Status: not implemented yet. The crate exists so that the workspace, its feature
//! layering and its CI are in place; it exports nothing.
#![forbid(unsafe_code)]
