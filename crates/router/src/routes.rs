//! The router's HTTP surface: its routes (the OpenAI endpoints behind the API keys, `/health`,
//! the admin endpoints behind their own check) and the server loop.

use std::future::Future;
use std::sync::Arc;

use axum::routing::{get, post};
use axum::serve::ListenerExt;

use crate::admin;
use crate::proxy::{chat_completions, completions, health, models, require_api_key, Router};

/// The router's routes.
pub fn app(router: Arc<Router>) -> axum::Router {
    let openai = axum::Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route_layer(axum::middleware::from_fn_with_state(router.clone(), require_api_key));
    axum::Router::new()
        .merge(openai)
        .route("/health", get(health))
        .merge(
            axum::Router::new()
                .route("/admin/engines", get(admin::list_engines).post(admin::add_engine).delete(admin::remove_engine))
                .route_layer(axum::middleware::from_fn_with_state(router.clone(), admin::require_admin)),
        )
        .with_state(router)
}

/// Serves the router on `listener` until `shutdown` resolves, checking the engines again
/// every `check_interval` meanwhile.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Arc<Router>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let _checks = router.spawn_checks();
    axum::serve(listener.tap_io(no_delay), app(router)).with_graceful_shutdown(shutdown).await
}

/// Streamed tokens are small writes: with Nagle's algorithm each waits for the client's
/// delayed ACK of the one before (40 ms on Linux; measured on every routed stream).
fn no_delay(tcp: &mut tokio::net::TcpStream) {
    if let Err(e) = tcp.set_nodelay(true) {
        tracing::warn!(error = %e, "could not set TCP_NODELAY; streamed tokens may wait on delayed ACKs");
    }
}
