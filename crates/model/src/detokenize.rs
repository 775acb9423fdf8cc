//! Turning a growing list of token ids into streamed text, and stop strings.

use crate::{ModelError, TextTokenizer};

/// Decodes tokens as they arrive and yields only complete new text.
///
/// A character can span several byte-level tokens; decoding token by token would emit broken
/// UTF-8. This keeps a small window (`prefix_offset..`) and emits the new text only when it no
/// longer ends in an incomplete character.
#[derive(Debug, Default)]
pub struct IncrementalDetokenizer {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl IncrementalDetokenizer {
    /// Starts after `context` (e.g. the prompt), whose text is not emitted.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds tokens and returns the text they complete (possibly empty). Special tokens are
    /// skipped, as OpenAI servers do by default.
    pub fn push(&mut self, tok: &TextTokenizer, new_ids: &[u32]) -> Result<String, ModelError> {
        self.ids.extend_from_slice(new_ids);
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset], true)?;
        let full = tok.decode(&self.ids[self.prefix_offset..], true)?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') {
            let delta = full.get(prefix.len()..).unwrap_or_default().to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            Ok(delta)
        } else {
            Ok(String::new())
        }
    }

    /// The text still held back when generation ends: bytes of a character that never
    /// completed come out as U+FFFD, as vLLM sends them, instead of being lost.
    pub fn finish(&mut self, tok: &TextTokenizer) -> Result<String, ModelError> {
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset], true)?;
        let full = tok.decode(&self.ids[self.prefix_offset..], true)?;
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        Ok(full.get(prefix.len()..).unwrap_or_default().to_string())
    }
}

/// Finds stop strings in streamed text, holding back text that might be the start of one so
/// a stop string is never partly sent.
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

/// What [`StopMatcher::feed`] decided.
#[derive(Debug, PartialEq, Eq)]
pub struct StopOutcome {
    /// Text that is safe to send now.
    pub emit: String,
    /// A stop string matched; generation should end and nothing after it is sent.
    pub stopped: bool,
}

impl StopMatcher {
    /// Matches any of `stops` (empty strings are ignored).
    pub fn new(stops: Vec<String>) -> Self {
        Self { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), held: String::new() }
    }

    /// Feeds new text.
    pub fn feed(&mut self, delta: &str) -> StopOutcome {
        if self.stops.is_empty() {
            return StopOutcome { emit: delta.to_string(), stopped: false };
        }
        self.held.push_str(delta);
        let earliest = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min();
        if let Some(at) = earliest {
            let emit = self.held[..at].to_string();
            self.held.clear();
            return StopOutcome { emit, stopped: true };
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let mut keep = 0;
        for stop in &self.stops {
            for (i, _) in stop.char_indices().skip(1) {
                if self.held.ends_with(&stop[..i]) {
                    keep = keep.max(i);
                }
            }
        }
        let cut = self.held.len() - keep;
        let emit = self.held[..cut].to_string();
        self.held.drain(..cut);
        StopOutcome { emit, stopped: false }
    }

    /// Text still held back when generation ends for another reason.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Preset;

    #[test]
    fn multibyte_characters_are_never_split() {
        let p = Preset::find("tiny-qwen3").unwrap();
        let tok = TextTokenizer::from_parts(p.tokenizer_json().as_bytes(), None).unwrap();
        let text = "añ世界🙂 ok";
        let ids = tok.encode(text, false).unwrap();
        let mut d = IncrementalDetokenizer::new();
        let mut out = String::new();
        for id in ids {
            let piece = d.push(&tok, &[id]).unwrap();
            assert!(!piece.contains('\u{FFFD}'));
            out.push_str(&piece);
        }
        assert_eq!(out, text);
    }

    #[test]
    fn an_incomplete_character_at_the_end_is_sent_as_a_replacement_character() {
        let p = Preset::find("tiny-qwen3").unwrap();
        let tok = TextTokenizer::from_parts(p.tokenizer_json().as_bytes(), None).unwrap();
        // "世" is three bytes; its first byte alone never completes.
        let ids = tok.encode("ok 世", false).unwrap();
        let byte_ids = &ids[..ids.len() - 1];
        assert!(tok.decode(byte_ids, true).unwrap().ends_with('\u{FFFD}'), "the test needs a split character");
        let mut d = IncrementalDetokenizer::new();
        let mut out = String::new();
        for &id in byte_ids {
            out.push_str(&d.push(&tok, &[id]).unwrap());
        }
        assert!(out.starts_with("ok") && !out.contains('\u{FFFD}'), "held back while it might complete: {out:?}");
        out.push_str(&d.finish(&tok).unwrap());
        assert_eq!(out, tok.decode(byte_ids, true).unwrap());
        assert!(out.starts_with("ok ") && out.ends_with('\u{FFFD}'), "{out:?}");
        assert_eq!(d.finish(&tok).unwrap(), "", "finish sends the rest once");
    }

    #[test]
    fn stop_string_split_across_pieces_is_held_then_cut() {
        let mut m = StopMatcher::new(vec!["STOP".into(), "\n\n".into()]);
        assert_eq!(m.feed("abc S"), StopOutcome { emit: "abc ".into(), stopped: false });
        assert_eq!(m.feed("T"), StopOutcome { emit: "".into(), stopped: false });
        assert_eq!(m.feed("OPxyz"), StopOutcome { emit: "".into(), stopped: true });
        let mut m = StopMatcher::new(vec!["STOP".into()]);
        assert_eq!(m.feed("ST"), StopOutcome { emit: "".into(), stopped: false });
        assert_eq!(m.feed("AY"), StopOutcome { emit: "STAY".into(), stopped: false });
        assert_eq!(m.feed("end S"), StopOutcome { emit: "end ".into(), stopped: false });
        assert_eq!(m.flush(), "S");
    }
}
