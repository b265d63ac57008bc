//! Serving the router over TLS: the client certificate (if any) verified by rustls becomes
//! the request's `Peer`.

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
