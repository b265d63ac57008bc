//! Serving the router over TLS: the client certificate (if any) verified by rustls becomes
//! the request's `Peer`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::{Extension, Router};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tower::Layer;

use crate::pki::Peer;

const TLS_HANDSHAKE_TIMEOUT_SECS: u64 = 10;
/// How long in-flight requests get to finish at shutdown.
const DRAIN_TIMEOUT_SECS: u64 = 5;

/// Connections the kernel holds until the accept loop takes them. When a controller starts
/// (or a replica takes over), its whole fleet connects at once while the TLS handshakes of
/// the first ones keep the runtime busy. With tokio's default of 1,024, 10,000 simulated
/// machines starting together overflowed it 6,859 and 12,185 times in two runs: each a
/// connection attempt dropped and sent again a second or more later, some after the agent's
/// connect timeout. The kernel caps it at `net.core.somaxconn` (4,096 by default).
const LISTEN_BACKLOG: u32 = 16_384;

/// A listener on `addr`, with room for a fleet connecting at once (`LISTEN_BACKLOG`).
pub fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
    // As `TcpListener::bind` does: a restarted controller binds while its old connections
    // linger in TIME-WAIT.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

pub async fn serve(listener: TcpListener, tls: Arc<rustls::ServerConfig>, router: Router, cancel: CancellationToken) -> anyhow::Result<()> {
    let acceptor = TlsAcceptor::from(tls);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    loop {
        let accepted = tokio::select! {
            _ = cancel.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let (tcp, remote) = match accepted {
            Ok(pair) => pair,
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        let acceptor = acceptor.clone();
        let router = router.clone();
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let tls = match tokio::time::timeout(Duration::from_secs(TLS_HANDSHAKE_TIMEOUT_SECS), acceptor.accept(tcp)).await {
                Ok(Ok(stream)) => stream,
                Ok(Err(e)) => {
                    tracing::debug!(%remote, error = %e, "TLS handshake failed");
                    return;
                }
                Err(_) => {
                    tracing::debug!(%remote, "TLS handshake timed out");
                    return;
                }
            };
            let peer = tls.get_ref().1.peer_certificates().and_then(|c| c.first()).map_or(Peer::Anonymous, Peer::from_certificate);
            // A layer on the service, not `Router::layer`: that would rebuild every route for
            // each connection (about 20 KiB each, 200 MiB for a 10,000-machine fleet).
            let service = TowerToHyperService::new(Extension(peer).layer(router));
            let builder = auto::Builder::new(TokioExecutor::new());
            let conn = builder.serve_connection(TokioIo::new(tls), service);
            if let Err(e) = watcher.watch(conn).await {
                tracing::debug!(%remote, error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(Duration::from_secs(DRAIN_TIMEOUT_SECS)) => tracing::info!("shutdown: gave up waiting for open connections"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use anyhow::Context;

    /// The listen queue the kernel gave the socket is what `ss` shows as its Send-Q.
    #[tokio::test]
    async fn the_listener_has_room_for_a_fleet_connecting_at_once() -> anyhow::Result<()> {
        let listener = super::listen("127.0.0.1:0".parse()?)?;
        let port = listener.local_addr()?.port();
        let shown = std::process::Command::new("ss").args(["-Hltn", &format!("sport = :{port}")]).output().context("running ss")?;
        let line = String::from_utf8(shown.stdout)?;
        let backlog: u32 = line.split_whitespace().nth(2).with_context(|| format!("ss showed {line:?}"))?.parse()?;
        let somaxconn: u32 = std::fs::read_to_string("/proc/sys/net/core/somaxconn")?.trim().parse()?;
        assert_eq!(backlog, super::LISTEN_BACKLOG.min(somaxconn), "ss showed {line:?}");
        // tokio's own default is 1,024; more whenever the kernel allows it.
        assert!(somaxconn <= 1024 || backlog > 1024, "backlog {backlog}");
        Ok(())
    }
}
