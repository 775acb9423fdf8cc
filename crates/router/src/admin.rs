//! The router's admin endpoints: `/admin/engines` lists, adds and removes engines while
//! serving, behind the cluster token or an `--admin-key` when the router has either.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use tandem_kv::Role;

use crate::answer::{bad_request, error};
use crate::backend::{Backend, BackendState};
use crate::proxy::{role_name, Router};

/// Lets a request through to `/admin/engines` only with the cluster secret's token or an admin
/// key, when the router has either (else open, as before either existed).
pub(crate) async fn require_admin(
    State(r): State<Arc<Router>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let allowed = {
        let (secret, keys) = (&r.cfg.cluster_secret, &r.cfg.admin_keys);
        let header = |name: &str| req.headers().get(name).map(|v| v.as_bytes());
        let open = secret.is_none() && !keys.required();
        let by_secret = secret.as_ref().is_some_and(|s| s.allows_token(header(tandem_core::CLUSTER_TOKEN_HEADER)));
        open || by_secret || (keys.required() && keys.allows(header(axum::http::header::AUTHORIZATION.as_str())))
    };
    if allowed {
        return next.run(req).await;
    }
    r.unauthorized.fetch_add(1, Ordering::Relaxed);
    error(
        StatusCode::UNAUTHORIZED,
        "the admin endpoints need `Authorization: Bearer <key>` with one of the router's --admin-key keys (or the cluster token)",
    )
}

impl Router {
    /// Checks an engine about to join (from `/admin/engines` or discovery): its state now, or
    /// why it cannot serve its role here (reached over https without a CA, another mode, no KV
    /// side channel, a model its peers cannot pair with). One not up yet is no reason to refuse.
    pub(crate) async fn vet(&self, b: &Backend) -> Result<BackendState, String> {
        if b.url.starts_with("https://") && self.cfg.engine_ca.is_none() {
            return Err(format!("{} is reached over https, and this router was given no --tls-ca to check it", b.url));
        }
        let state = self.probe(b).await;
        if let BackendState::Misconfigured(why) = &state {
            return Err(format!("engine {} {why}", b.url));
        }
        if let BackendState::Ready(info) = &state {
            let others = match b.role {
                Role::Prefill => self.decode.list(),
                _ => self.prefill.list(),
            };
            let unpairable = others.iter().find_map(|o| {
                let other = o.info()?;
                let check =
                    if b.role == Role::Prefill { other.check_pairing(info) } else { info.check_pairing(&other) };
                check.err().map(|e| format!("engine {} cannot pair with {}: {e}", b.url, o.url))
            });
            if let Some(why) = unpairable {
                return Err(why);
            }
        }
        Ok(state)
    }
}

/// `GET /admin/engines`: every engine by role, with its state and requests in flight.
pub(crate) async fn list_engines(State(r): State<Arc<Router>>) -> Response {
    let describe = |list: &[Arc<Backend>]| -> Vec<Value> {
        list.iter()
            .map(|b| {
                let state = match b.state() {
                    BackendState::Ready(_) => "ready".to_string(),
                    BackendState::Unknown => "not checked yet".to_string(),
                    BackendState::Down(why) => format!("down: {why}"),
                    BackendState::Misconfigured(why) => format!("misconfigured: {why}"),
                };
                json!({"url": b.url, "state": state, "outstanding": b.outstanding()})
            })
            .collect()
    };
    Json(json!({"prefill": describe(&r.prefill.list()), "decode": describe(&r.decode.list())})).into_response()
}

/// `POST /admin/engines` `{"role": "prefill"|"decode", "url": ...}`: adds an engine while
/// serving. It is checked at once: one that cannot serve the role (another mode, no KV side
/// channel, a model its peers cannot pair with) is refused with the reason; one not up yet is
/// added and taken into service when a check finds it ready.
pub(crate) async fn add_engine(State(r): State<Arc<Router>>, body: Bytes) -> Response {
    let v: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("invalid request body (not valid JSON): {e}")),
    };
    let (role, engines) = match v["role"].as_str() {
        Some("prefill") => (Role::Prefill, &r.prefill),
        Some("decode") => (Role::Decode, &r.decode),
        _ => return bad_request("role", "`role` must be \"prefill\" or \"decode\""),
    };
    let Some(url) = v["url"].as_str().filter(|u| u.starts_with("http://") || u.starts_with("https://")) else {
        return bad_request("url", "`url` must be an engine's base URL, e.g. http://127.0.0.1:8100");
    };
    let b = Arc::new(Backend::new(url, role));
    let state = match r.vet(&b).await {
        Ok(state) => state,
        Err(why) => return bad_request("url", why),
    };
    b.set_state(state);
    if !engines.add(b.clone()) {
        return error(StatusCode::CONFLICT, format!("engine {} is already a {} engine here", b.url, role_name(role)));
    }
    tracing::info!(url = %b.url, role = role_name(role), "engine added");
    list_engines(State(r)).await
}

/// `DELETE /admin/engines` `{"url": ...}`: takes an engine out of service; requests it is
/// answering finish there. The last engine of a role stays (409).
pub(crate) async fn remove_engine(State(r): State<Arc<Router>>, body: Bytes) -> Response {
    let v: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("invalid request body (not valid JSON): {e}")),
    };
    let Some(url) = v["url"].as_str() else { return bad_request("url", "`url` is required") };
    let url = url.trim_end_matches('/');
    let removed = match r.prefill.remove(url) {
        Ok(false) => r.decode.remove(url),
        other => other,
    };
    match removed {
        Ok(true) => {
            tracing::info!(%url, "engine removed");
            list_engines(State(r)).await
        }
        Ok(false) => error(StatusCode::NOT_FOUND, format!("no engine {url} here")),
        Err(why) => error(StatusCode::CONFLICT, why),
    }
}
