//! Socket writes that never raise SIGPIPE, what the kernel still holds of
//! them, and the kernel's receive buffer of a connection.
//!
//! `std`'s `write` on a socket passes `MSG_NOSIGNAL`, but `write_vectored` is a
//! plain `writev`, and a `writev` to a socket whose peer is gone raises SIGPIPE,
//! which kills a process (a Python host, say) that has not ignored it. Every
//! write of the provider goes through [`NoSigPipe`] instead.

use std::io::{self, IoSlice, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::OnceLock;

/// A writer over a connected socket that sends with `MSG_NOSIGNAL`.
pub(crate) struct NoSigPipe<'a, S: AsRawFd>(pub(crate) &'a S);

fn fd_of(socket: &impl AsRawFd) -> RawFd {
    socket.as_raw_fd()
}

/// Bytes of an `int` socket option.
#[expect(clippy::cast_possible_truncation, reason = "an int's 4 bytes")]
const INT_LEN: libc::socklen_t = size_of::<libc::c_int>() as libc::socklen_t;

/// Asks the kernel for a receive buffer of `bytes` on `socket` (`SO_RCVBUF`),
/// where it allows that much (`net.core.rmem_max`: above it the kernel would
/// cut the ask down, on a stock kernel to about 200 KiB, far below what
/// autotuning reaches); otherwise, and for 0, leaves the buffer to the
/// kernel's autotuning. A fixed buffer replaces autotuning for the
/// connection's life, whose ceiling (`net.ipv4.tcp_rmem`'s third field) may
/// be higher: a link whose bandwidth-delay product exceeds the buffer wants
/// 0. Returns whether it asked.
///
/// Autotuning grows a buffer as the application reads; on two cores, where
/// the reader is a spinning rank that shares its core, it does not always
/// grow, and 2x1 tcp all-reduces of 1 MiB ran bimodal, at 2.5 or 4.3 GB/s
/// from one job to the next (see `TcpConfig::receive_buffer`).
pub(crate) fn ask_receive_buffer(socket: &impl AsRawFd, bytes: usize) -> bool {
    let Ok(asked) = libc::c_int::try_from(bytes) else {
        return false;
    };
    if asked == 0 || receive_buffer_limit().is_none_or(|limit| limit < bytes) {
        return false;
    }
    // SAFETY: `SO_RCVBUF` reads one `int` from the pointer, valid for reads for
    // the call; the descriptor belongs to a live socket borrowed for the call.
    let r = unsafe {
        libc::setsockopt(
            fd_of(socket),
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&raw const asked).cast(),
            INT_LEN,
        )
    };
    r == 0
}

/// The most a process may ask for as a socket's receive buffer
/// (`/proc/sys/net/core/rmem_max`), read once; `None` where it cannot be read.
fn receive_buffer_limit() -> Option<usize> {
    static LIMIT: OnceLock<Option<usize>> = OnceLock::new();
    *LIMIT.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/net/core/rmem_max")
            .ok()?
            .trim()
            .parse()
            .ok()
    })
}

/// The receive buffer the kernel gives `socket` (`SO_RCVBUF`: twice what was
/// asked, for its own bookkeeping); `None` if it does not say.
#[cfg(test)]
pub(crate) fn receive_buffer(socket: &impl AsRawFd) -> Option<usize> {
    let mut n: libc::c_int = 0;
    let mut len = INT_LEN;
    // SAFETY: `SO_RCVBUF` writes one `int` through the pointer and its length
    // through `len`, both valid for writes for the call; the descriptor belongs
    // to a live socket borrowed for the call.
    let r = unsafe {
        libc::getsockopt(
            fd_of(socket),
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&raw mut n).cast(),
            &raw mut len,
        )
    };
    (r == 0).then(|| usize::try_from(n).unwrap_or(0))
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

#[cfg(test)]
mod tests {
    use std::net::{TcpListener, TcpStream};

    use super::*;

    fn connected() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback listener");
        let dialed =
            TcpStream::connect(listener.local_addr().expect("its address")).expect("dialing");
        let (accepted, _) = listener.accept().expect("accepting");
        (dialed, accepted)
    }

    #[test]
    fn a_receive_buffer_is_asked_for_only_where_the_kernel_allows_it() {
        let (socket, _peer) = connected();
        let before = receive_buffer(&socket).expect("the kernel says");
        assert!(!ask_receive_buffer(&socket, 0), "0 leaves autotuning");
        assert_eq!(receive_buffer(&socket), Some(before));
        let Some(limit) = receive_buffer_limit() else {
            assert!(!ask_receive_buffer(&socket, 1 << 20), "no limit read");
            return;
        };
        // Above the limit: nothing is asked, and autotuning stays.
        assert!(!ask_receive_buffer(&socket, limit + 1));
        assert_eq!(receive_buffer(&socket), Some(before));
        // At most the limit: the kernel gives at least that much (twice it).
        let asked = limit.min(1 << 20);
        assert!(ask_receive_buffer(&socket, asked));
        let given = receive_buffer(&socket).expect("the kernel says");
        assert!(given >= asked, "asked {asked}, given {given}");
    }
}
