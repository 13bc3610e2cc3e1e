//! The fabric of fairring: an RDMA-shaped transport.
//!
//! This crate is where the inter-machine step of the all-reduce will travel. It will
//! offer one API that a hardware and a software provider both implement, in the way
//! libfabric does:
//!
//! - register a memory region (host memory, and device memory for the verbs provider);
//! - connect to a peer, admitted only after a mutual HMAC-SHA256 challenge over the
//!   job secret;
//! - post a one-sided *write with immediate data* of a local byte range into a peer's
//!   region at an offset;
//! - poll a completion queue, without allocating, for local completions, for remote
//!   writes that landed, and for errors that name the peer.
//!
//! Providers, one folder each: `tcp` (feature `tcp`, always available: each write is a
//! [`fairring_core::wire`] frame header plus its payload, bounds-checked before a byte
//! is written) and `verbs` (feature `verbs`: RC queue pairs, RDMA write with immediate,
//! GPUDirect registration).
//!
//! Status: not implemented yet. The crate exists so that the workspace, its feature
//! layering and its CI are in place; it exports nothing.
#![forbid(unsafe_code)]
