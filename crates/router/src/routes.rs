//! The router's HTTP surface: its routes (the OpenAI endpoints behind the API keys, `/health`,
//! the admin endpoints behind their own check) and the server loop.

use std::future::Future;
use std::sync::Arc;

use axum::routing::{get, post};

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

/// Serves the router on `listener` (over TLS when `tls` is given) until `shutdown` resolves,
/// checking the engines again every `check_interval` meanwhile.
pub async fn serve(
    listener: tokio::net::TcpListener,
    tls: Option<tandem_tls::HttpsConfig>,
    router: Arc<Router>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let _checks = router.spawn_checks();
    tandem_tls::http::serve(listener, tls, app(router), shutdown).await
}
