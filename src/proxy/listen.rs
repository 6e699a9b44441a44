//! The listening sockets of the proxy (HTTP, HTTPS) and of stream routes, with the configured
//! accept backlog (`proxy.listen_backlog`): how many connections the kernel completes and holds
//! for the gateway while it is busy before it drops new SYNs. Admitting them is
//! `proxy.max_connections`'s job; the backlog only absorbs bursts between accepts.

use std::io;
use std::net::SocketAddr;

use socket2::{Domain, Protocol, Socket, Type};

/// Binds `address` and listens with room for `backlog` pending connections (the kernel caps it
/// at `net.core.somaxconn`). Non-blocking, for tokio. Sets `SO_REUSEADDR` as std and tokio do on
/// Unix, so a port whose old connections linger in TIME_WAIT binds again at once; it does not
/// let two listeners share a port.
pub fn bind_listener(address: SocketAddr, backlog: u32) -> io::Result<std::net::TcpListener> {
    let socket = Socket::new(
        Domain::for_address(address),
        Type::STREAM,
        Some(Protocol::TCP),
    )?;
    #[cfg(unix)]
    socket.set_reuse_address(true)?;
    socket.bind(&address.into())?;
    socket.listen(i32::try_from(backlog).unwrap_or(i32::MAX))?;
    socket.set_nonblocking(true)?;
    Ok(socket.into())
}
