//! Socket writes that never raise SIGPIPE, and what the kernel still holds of
//! them.
//!
//! `std`'s `write` on a socket passes `MSG_NOSIGNAL`, but `write_vectored` is a
//! plain `writev`, and a `writev` to a socket whose peer is gone raises SIGPIPE,
//! which kills a process (a Python host, say) that has not ignored it. Every
//! write of the provider goes through [`NoSigPipe`] instead.

use std::io::{self, IoSlice, Write};
use std::os::fd::{AsRawFd, RawFd};

/// A writer over a connected socket that sends with `MSG_NOSIGNAL`.
pub(crate) struct NoSigPipe<'a, S: AsRawFd>(pub(crate) &'a S);

fn fd_of(socket: &impl AsRawFd) -> RawFd {
    socket.as_raw_fd()
}

/// Bytes written to a connected socket that its peer has not acknowledged yet
/// (`SIOCOUTQ`, which Linux also spells `TIOCOUTQ`); `None` if the kernel does
/// not say.
pub(crate) fn unacknowledged(socket: &impl AsRawFd) -> Option<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: `TIOCOUTQ` on a socket writes one `int` through the pointer, which
    // is valid for writes for the call; the descriptor belongs to a live socket
    // borrowed for the call.
    let r = unsafe { libc::ioctl(fd_of(socket), libc::TIOCOUTQ, &raw mut n) };
    (r == 0).then(|| usize::try_from(n).unwrap_or(0))
}

/// Reads and drops whatever the peer has sent that waits in the socket, without
/// blocking; returns whether the connection is still open both ways (`false`
/// once the peer closed it, or it failed).
pub(crate) fn discard_incoming(socket: &impl AsRawFd) -> bool {
    let mut scratch = [0u8; 4096];
    loop {
        // SAFETY: `scratch` is valid for writes of its length for the call; the
        // descriptor belongs to a live socket borrowed for the call.
        let n = unsafe {
            libc::recv(
                fd_of(socket),
                scratch.as_mut_ptr().cast(),
                scratch.len(),
                libc::MSG_DONTWAIT,
            )
        };
        match n {
            0 => return false,
            n if n > 0 => {}
            _ => {
                let e = io::Error::last_os_error();
                match e.kind() {
                    io::ErrorKind::WouldBlock => return true,
                    io::ErrorKind::Interrupted => {}
                    _ => return false,
                }
            }
        }
    }
}

impl<S: AsRawFd> Write for NoSigPipe<'_, S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        // SAFETY: `buf` is valid for `buf.len()` bytes of reads for the call; the
        // descriptor belongs to a live socket borrowed for the call.
        let n = unsafe {
            libc::send(
                fd_of(self.0),
                buf.as_ptr().cast(),
                buf.len(),
                libc::MSG_NOSIGNAL,
            )
        };
        usize::try_from(n).map_err(|_| io::Error::last_os_error())
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        // SAFETY: an all-zero `msghdr` is a valid empty message.
        let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
        // `IoSlice` is ABI-compatible with `iovec` on Unix (documented by std).
        message.msg_iov = bufs.as_ptr().cast_mut().cast();
        message.msg_iovlen = bufs.len().min(1024) as _;
        // SAFETY: `message` points at `bufs`, whose slices are valid for reads for
        // the call; `sendmsg` does not write through `msg_iov`.
        let n = unsafe { libc::sendmsg(fd_of(self.0), &message, libc::MSG_NOSIGNAL) };
        usize::try_from(n).map_err(|_| io::Error::last_os_error())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
