//! Text in and out: the HF `tokenizer.json` through the `tokenizers` crate, and the chat
//! template (`chat_template.jinja`, or `tokenizer_config.json`'s, a string or the `default` of a
//! list of named templates) rendered with minijinja.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ModelError;

/// One chat message, already flattened to text.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The message text.
    pub content: String,
}

/// A model's tokenizer and chat template.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    template: Option<minijinja::Environment<'static>>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl TextTokenizer {
    /// Loads `dir/tokenizer.json` (and `dir/tokenizer_config.json` if present). Returns
    /// `Ok(None)` when the directory has no tokenizer: the model then runs in token-ids mode.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>, ModelError> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            return Ok(None);
        }
        let bytes = std::fs::read(&path).map_err(|e| ModelError::io(&path, e))?;
        let cfg_path = dir.join("tokenizer_config.json");
        let mut config: Option<Value> = if cfg_path.is_file() {
            let text = std::fs::read_to_string(&cfg_path).map_err(|e| ModelError::io(&cfg_path, e))?;
            Some(serde_json::from_str(&text).map_err(|source| ModelError::Json { path: cfg_path, error: source })?)
        } else {
            None
        };
        // transformers (4.43 on) saves the template beside the config as chat_template.jinja,
        // and reads it from there before the config's own.
        let jinja = dir.join("chat_template.jinja");
        if jinja.is_file() {
            let src = std::fs::read_to_string(&jinja).map_err(|e| ModelError::io(&jinja, e))?;
            let cfg = config.get_or_insert_with(|| Value::Object(Default::default()));
            if let Value::Object(map) = cfg {
                map.insert("chat_template".into(), Value::String(src));
            }
        }
        Self::from_parts(&bytes, config.as_ref()).map(Some)
    }

    /// Builds a tokenizer from tokenizer.json bytes and an optional tokenizer_config.json value.
    pub fn from_parts(tokenizer_json: &[u8], config: Option<&Value>) -> Result<Self, ModelError> {
        let inner =
            tokenizers::Tokenizer::from_bytes(tokenizer_json).map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        let token_text = |key: &str| {
            config.and_then(|c| c.get(key)).and_then(|v| match v {
                Value::String(s) => Some(s.clone()),
                Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
                _ => None,
            })
        };
        let template = match config.and_then(|c| c.get("chat_template")) {
            Some(Value::String(src)) => Some(compile_template(src.clone())?),
            // A list of named templates: use the one called "default".
            Some(Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template").and_then(Value::as_str))
                .map(|src| compile_template(src.to_string()))
                .transpose()?,
            _ => None,
        };
        Ok(Self { inner, template, bos_token: token_text("bos_token"), eos_token: token_text("eos_token") })
    }

    /// Token ids of `text`. `add_special_tokens` applies the tokenizer's post-processor
    /// (e.g. a BOS token); chat prompts already carry their special tokens.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, ModelError> {
        self.inner
            .encode(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| ModelError::Tokenizer(e.to_string()))
    }

    /// Text of `ids`; ids the tokenizer does not know decode to nothing.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, ModelError> {
        let known: Vec<u32> = ids.iter().copied().filter(|&id| self.inner.id_to_token(id).is_some()).collect();
        self.inner.decode(&known, skip_special_tokens).map_err(|e| ModelError::Tokenizer(e.to_string()))
    }

    /// The id of a token string, if it is in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The id of the tokenizer config's `eos_token`.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token.as_deref().and_then(|t| self.token_to_id(t))
    }

    /// Replaces the chat template with `source` (Jinja, as in tokenizer_config.json): an error
    /// names what does not parse.
    pub fn set_chat_template(&mut self, source: String) -> Result<(), ModelError> {
        self.template = Some(compile_template(source)?);
        Ok(())
    }

    /// Whether a chat template is available.
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// Renders the chat template over `messages`.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ModelError> {
        let env =
            self.template.as_ref().ok_or_else(|| ModelError::ChatTemplate("this model has no chat template".into()))?;
        let tmpl = env.get_template("chat").map_err(|e| ModelError::ChatTemplate(e.to_string()))?;
        tmpl.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
        })
        .map_err(|e| ModelError::ChatTemplate(e.to_string()))
    }
}

fn compile_template(source: String) -> Result<minijinja::Environment<'static>, ModelError> {
    let mut env = minijinja::Environment::new();
    // HF templates are Jinja written for Python: they call str methods like .strip().
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
        Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
    });
    env.add_template_owned("chat", source).map_err(|e| ModelError::ChatTemplate(e.to_string()))?;
    Ok(env)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Preset;

    fn tiny() -> TextTokenizer {
        let p = Preset::find("tiny-qwen3").unwrap();
        TextTokenizer::from_parts(p.tokenizer_json().as_bytes(), Some(&p.tokenizer_config_json())).unwrap()
    }

    #[test]
    fn preset_tokenizer_round_trips_any_text() {
        let t = tiny();
        for text in ["hello world", "Grüße, 世界! 123\n\ttabs", " leading space", ""] {
            let ids = t.encode(text, false).unwrap();
            assert_eq!(t.decode(&ids, false).unwrap(), text);
        }
        // Merges compress lowercase words below one token per byte.
        assert!(t.encode("the quick brown fox jumps over the lazy dog", false).unwrap().len() < 43);
    }

    /// A directory as transformers 5 saves it: the template in chat_template.jinja, none in
    /// tokenizer_config.json; and a config with a list of named templates.
    #[test]
    fn templates_come_from_chat_template_jinja_or_a_named_list() {
        let p = Preset::find("tiny-qwen3").unwrap();
        let dir = std::env::temp_dir().join(format!("tandem-jinja-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("tokenizer.json"), p.tokenizer_json()).unwrap();
        let mut cfg = p.tokenizer_config_json();
        cfg.as_object_mut().unwrap().remove("chat_template");
        std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
        let msgs = [ChatMessage { role: "user".into(), content: "hi".into() }];
        assert!(!TextTokenizer::from_dir(&dir).unwrap().unwrap().has_chat_template());
        let jinja = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}";
        std::fs::write(dir.join("chat_template.jinja"), jinja).unwrap();
        let t = TextTokenizer::from_dir(&dir).unwrap().unwrap();
        assert_eq!(t.apply_chat_template(&msgs, true).unwrap(), "[user] hi\n[assistant] ");
        std::fs::remove_dir_all(&dir).unwrap();
        let named = serde_json::json!({"chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "{{ messages[0].content }}!"},
        ]});
        let t = TextTokenizer::from_parts(p.tokenizer_json().as_bytes(), Some(&named)).unwrap();
        assert_eq!(t.apply_chat_template(&msgs, false).unwrap(), "hi!");
    }

    #[test]
    fn chatml_template_renders_and_specials_are_single_tokens() {
        let t = tiny();
        let msgs = [ChatMessage { role: "user".into(), content: "hi".into() }];
        let text = t.apply_chat_template(&msgs, true).unwrap();
        assert_eq!(text, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
        let ids = t.encode(&text, false).unwrap();
        assert_eq!(ids[0], t.token_to_id("<|im_start|>").unwrap());
        assert_eq!(t.eos_token_id(), t.token_to_id("<|im_end|>"));
        assert_eq!(t.decode(&ids, true).unwrap(), "user\nhi\nassistant\n");
    }
}
