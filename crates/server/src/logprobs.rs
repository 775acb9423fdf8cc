//! `logprobs` in and out: what a request asks for in each API's spelling, and the response's
//! `logprobs` object in each API's shape (OpenAI's, as vLLM fills it).
//!
//! - Completions ask with `logprobs: N` (0-20 alternatives) and get `{tokens, token_logprobs,
//!   top_logprobs, text_offset}`; each `top_logprobs` entry maps token text to log-probability
//!   and also holds the chosen token, as vLLM's does.
//! - Chat asks with `logprobs: true` and `top_logprobs: N` and gets `{content: [{token, logprob,
//!   bytes, top_logprobs: [{token, logprob, bytes}]}]}`.
//!
//! Log-probabilities are of the model's raw distribution (before temperature and the other
//! sampling settings), as vLLM reports them by default. A token is named by its text (the
//! tokenizer's decoding of it alone), or `token_id:N` for a model served without a tokenizer.

use serde_json::{json, Map, Value};
use tandem_core::{TokenLogprobs, MAX_LOGPROBS};
use tandem_model::TextTokenizer;

use crate::protocol::Api;
use crate::ApiError;

/// How many alternatives a request asks log-probabilities for (`None`: none), from `logprobs`
/// and chat's `top_logprobs`.
pub(crate) fn requested(
    api: Api,
    logprobs: Option<&Value>,
    top_logprobs: Option<i64>,
) -> Result<Option<u32>, ApiError> {
    let count = |param: &'static str, n: i64| match u32::try_from(n) {
        Ok(n) if n <= MAX_LOGPROBS => Ok(n),
        _ => Err(ApiError::bad(param, format!("{param} must be between 0 and {MAX_LOGPROBS}, got {n}"))),
    };
    match api {
        Api::Completion => {
            if top_logprobs.is_some() {
                return Err(ApiError::bad(
                    "top_logprobs",
                    "top_logprobs is a chat field; completions take logprobs: N (alternatives per token)",
                ));
            }
            match logprobs {
                None | Some(Value::Null) => Ok(None),
                Some(Value::Number(n)) if n.as_i64().is_some() => count("logprobs", n.as_i64().unwrap_or(0)).map(Some),
                Some(v) => Err(ApiError::bad(
                    "logprobs",
                    format!("logprobs must be an integer between 0 and {MAX_LOGPROBS} for completions, got {v}"),
                )),
            }
        }
        Api::Chat => {
            let on = match logprobs {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(v) => {
                    return Err(ApiError::bad("logprobs", format!("logprobs must be true or false for chat, got {v}")))
                }
            };
            match (on, top_logprobs) {
                (false, Some(_)) => Err(ApiError::bad("top_logprobs", "top_logprobs needs logprobs: true")),
                (false, None) => Ok(None),
                (true, top) => count("top_logprobs", top.unwrap_or(0)).map(Some),
            }
        }
    }
}

/// The `logprobs` object for `token_ids` (whose log-probabilities are `lps`), or `None` (JSON
/// null) when the request asked for none. `text_offset` is where the completion's text so far
/// ends (in characters); it moves past these tokens. Leading tokens without log-probabilities
/// (a resumed request's earlier output, whose were computed by another engine, and which the
/// router leaves out of what the client gets) have no entries; they only move the offset.
pub(crate) fn to_json(
    api: Api,
    tokenizer: Option<&TextTokenizer>,
    token_ids: &[u32],
    lps: &[TokenLogprobs],
    text_offset: &mut usize,
) -> Option<Value> {
    if lps.is_empty() {
        return None;
    }
    let text = |id: u32| match tokenizer {
        Some(t) => t.decode(&[id], false).unwrap_or_default(),
        None => format!("token_id:{id}"),
    };
    // JSON has no -inf (a banned or impossible token): vLLM's stand-in.
    let finite = |lp: f32| if lp.is_finite() { lp } else { -9999.0 };
    let (earlier, token_ids) = token_ids.split_at(token_ids.len().saturating_sub(lps.len()));
    *text_offset += earlier.iter().map(|&id| text(id).chars().count()).sum::<usize>();
    let pairs = token_ids.iter().zip(lps);
    Some(match api {
        Api::Completion => {
            let (mut tokens, mut token_logprobs, mut top_logprobs, mut offsets) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for (&id, lp) in pairs {
                let s = text(id);
                let mut top = Map::new();
                for &(alt, alt_lp) in &lp.top {
                    top.insert(text(alt), json!(finite(alt_lp)));
                }
                top.entry(s.clone()).or_insert(json!(finite(lp.logprob)));
                offsets.push(*text_offset);
                *text_offset += s.chars().count();
                token_logprobs.push(json!(finite(lp.logprob)));
                top_logprobs.push(Value::Object(top));
                tokens.push(s);
            }
            json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                   "text_offset": offsets})
        }
        Api::Chat => {
            let entry = |s: String, lp: f32| json!({"token": s, "logprob": finite(lp), "bytes": s.as_bytes()});
            let content: Vec<Value> = pairs
                .map(|(&id, lp)| {
                    let mut e = entry(text(id), lp.logprob);
                    let top: Vec<Value> = lp.top.iter().map(|&(alt, alt_lp)| entry(text(alt), alt_lp)).collect();
                    e["top_logprobs"] = Value::Array(top);
                    e
                })
                .collect();
            json!({ "content": content })
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lp(logprob: f32, top: &[(u32, f32)]) -> TokenLogprobs {
        TokenLogprobs { logprob, top: top.to_vec() }
    }

    #[test]
    fn each_api_asks_in_its_own_spelling_and_bad_values_name_the_field() {
        let ok = |api, l: Value, t| requested(api, Some(&l), t).unwrap();
        assert_eq!(ok(Api::Completion, json!(3), None), Some(3));
        assert_eq!(ok(Api::Completion, json!(0), None), Some(0));
        assert_eq!(ok(Api::Completion, Value::Null, None), None);
        assert_eq!(ok(Api::Chat, json!(true), Some(5)), Some(5));
        assert_eq!(ok(Api::Chat, json!(true), None), Some(0));
        assert_eq!(ok(Api::Chat, json!(false), None), None);
        let bad = |api, l: Value, t| requested(api, Some(&l), t).unwrap_err().to_string();
        assert!(bad(Api::Completion, json!(21), None).contains("between 0 and 20"));
        assert!(bad(Api::Completion, json!(-1), None).contains("between 0 and 20"));
        assert!(bad(Api::Completion, json!(true), None).contains("must be an integer"));
        assert!(bad(Api::Completion, json!(2), Some(2)).contains("top_logprobs is a chat field"));
        assert!(bad(Api::Chat, json!(3), None).contains("true or false"));
        assert!(bad(Api::Chat, json!(false), Some(2)).contains("needs logprobs: true"));
        assert!(bad(Api::Chat, json!(true), Some(99)).contains("top_logprobs must be between"));
    }

    #[test]
    fn the_shapes_are_openais_and_the_offsets_run_on() {
        let lps = [lp(-0.5, &[(7, -0.5), (9, -1.0)]), lp(f32::NEG_INFINITY, &[(3, -0.1)])];
        let mut offset = 10;
        let c = to_json(Api::Completion, None, &[7, 8], &lps, &mut offset).unwrap();
        assert_eq!(c["tokens"], json!(["token_id:7", "token_id:8"]));
        assert_eq!(c["token_logprobs"], json!([-0.5, -9999.0]));
        assert_eq!(c["top_logprobs"][0], json!({"token_id:7": -0.5, "token_id:9": -1.0}));
        // The chosen token is in its entry even when it is not among the most likely.
        assert_eq!(c["top_logprobs"][1], json!({"token_id:3": -0.1f32, "token_id:8": -9999.0}));
        assert_eq!(c["text_offset"], json!([10, 20]));
        assert_eq!(offset, 30);
        let chat = to_json(Api::Chat, None, &[7], &lps[..1], &mut 0).unwrap();
        let first = &chat["content"][0];
        assert_eq!((first["token"].clone(), first["logprob"].clone()), (json!("token_id:7"), json!(-0.5)));
        assert_eq!(first["bytes"], json!("token_id:7".as_bytes()));
        assert_eq!(first["top_logprobs"][1]["token"], json!("token_id:9"));
        assert_eq!(to_json(Api::Chat, None, &[7], &[], &mut 0), None, "not asked: null");
    }
}
