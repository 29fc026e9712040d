//! Reads the token usage and the serving model from an AI provider's answer
//! while its body streams to the client, without buffering the body.
//!
//! The body goes through a byte-level JSON state machine that only follows
//! the structure of each document down to `response.*`. Every other value is
//! skipped byte by byte; a value at an interesting path is kept (up to
//! [`VALUE_CAP`] bytes) and parsed with `serde_json` once it ends. So memory
//! stays bounded whatever the size of the body or of its lines.

use serde_json::Value;

/// Longest key kept; every interesting key is far shorter, so a longer key
/// (kept cut) never matches.
const KEY_CAP: usize = 64;
/// Largest interesting value kept; a longer one is dropped.
const VALUE_CAP: usize = 16 * 1024;
/// Content types of newline-delimited JSON.
const NDJSON_TYPES: [&str; 4] = [
    "application/x-ndjson",
    "application/ndjson",
    "application/jsonl",
    "application/json-lines",
];

/// How the answer's body is framed, from its Content-Type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Framing {
    Json,
    EventStream,
    Ndjson,
}

impl Framing {
    /// `text/event-stream` → EventStream; `application/x-ndjson`,
    /// `application/ndjson`, `application/jsonl`, `application/json-lines` →
    /// Ndjson; anything else (including a missing content type) → Json.
    /// Case-insensitive, parameters after `;` ignored.
    pub(super) fn of(content_type: Option<&str>) -> Self {
        let essence = content_type.unwrap_or("").split(';').next().unwrap_or("").trim();
        if essence.eq_ignore_ascii_case("text/event-stream") {
            Self::EventStream
        } else if NDJSON_TYPES.iter().any(|t| essence.eq_ignore_ascii_case(t)) {
            Self::Ndjson
        } else {
            Self::Json
        }
    }
}

/// What was read from an answer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Read {
    pub(super) input_tokens: Option<i64>,
    pub(super) output_tokens: Option<i64>,
    pub(super) model: Option<String>,
}

/// Reads an answer's body as it streams past.
pub(super) struct Reader {
    framing: Framing,
    line: Line,
    parser: Parser,
    read: Read,
    /// How much of the line's payload has spelled `[DONE]` so far (`None`
    /// once it spelled something else).
    marker: Option<usize>,
    /// A line ended that said the answer is complete.
    finished: bool,
}

/// OpenAI's last event-stream payload: the answer is complete.
const DONE: &[u8] = b"[DONE]";

impl Reader {
    pub(super) fn new(framing: Framing) -> Self {
        Self {
            framing,
            line: Line::start(framing),
            parser: Parser::new(framing == Framing::Json),
            read: Read::default(),
            // Only a line framing's payload can spell it.
            marker: (framing != Framing::Json).then_some(0),
            finished: false,
        }
    }

    /// Whether a streamed answer said it is complete, with the line that
    /// said so ended: OpenAI's `data: [DONE]`, Ollama's `"done": true`, the
    /// Responses API's `response.completed`, Anthropic's `message_stop`. A client may hang up at that
    /// point without reading the end of the body (the `openai` package
    /// does), so the call is over there. Always `false` for a JSON body,
    /// whose end is the body's.
    pub(super) fn finished(&self) -> bool {
        self.finished
    }

    /// Reads the next chunk of the body. Never fails, never panics, whatever the bytes.
    pub(super) fn feed(&mut self, chunk: &[u8]) {
        let mut rest = chunk;
        while let Some((&b, tail)) = rest.split_first() {
            self.byte(b);
            // Most of a big body is skipped: jump to the next byte that
            // matters (none while the payload may still spell `[DONE]`).
            let skip = if self.marker.is_some() {
                0
            } else {
                self.parser.skippable(tail)
            };
            rest = tail.get(skip..).unwrap_or_default();
        }
    }

    /// What was read, once the body ended (or was cut).
    pub(super) fn read(&self) -> Read {
        self.read.clone()
    }

    /// Capacities of the key and value buffers, to check they stay capped.
    #[cfg(test)]
    fn buffer_capacities(&self) -> (usize, usize) {
        (self.parser.key_buf.capacity(), self.parser.value_buf.capacity())
    }

    fn byte(&mut self, b: u8) {
        if self.framing == Framing::Json {
            return self.parser.byte(b, &mut self.read);
        }
        if b == b'\n' || b == b'\r' {
            let said_done = self.marker == Some(DONE.len()) || self.parser.said_done;
            let complete = self.parser.state == State::Stopped || self.marker == Some(DONE.len());
            if said_done && complete {
                self.finished = true;
            }
            // A line is a document of its own: whatever it left unfinished is dropped.
            self.line = Line::start(self.framing);
            self.parser.reset();
            self.marker = Some(0);
            return;
        }
        match self.line {
            Line::Field(matched) => self.line = Line::field(matched, b),
            Line::Gap => {
                self.line = Line::Payload;
                if b != b' ' {
                    self.payload(b);
                }
            }
            Line::Payload => self.payload(b),
            Line::Ignored => {}
        }
    }

    /// A byte of a line's document.
    fn payload(&mut self, b: u8) {
        self.marker = self
            .marker
            .filter(|&matched| DONE.get(matched) == Some(&b))
            .map(|matched| matched + 1);
        self.parser.byte(b, &mut self.read);
    }
}

/// Where a line framing is in the current line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Line {
    /// Reading an event-stream field name; holds how many bytes of `data` matched.
    Field(usize),
    /// Just after `data:`, where one space may stand.
    Gap,
    /// In the JSON document of the line.
    Payload,
    /// In a line that carries no document.
    Ignored,
}

impl Line {
    fn start(framing: Framing) -> Self {
        match framing {
            Framing::EventStream => Self::Field(0),
            Framing::Json | Framing::Ndjson => Self::Payload,
        }
    }

    /// Only a `data` field carries a document; `event:`, `id:`, comments… don't.
    fn field(matched: usize, b: u8) -> Self {
        const DATA: &[u8] = b"data";
        match DATA.get(matched) {
            Some(&expected) if expected == b => Self::Field(matched + 1),
            None if b == b':' => Self::Gap,
            _ => Self::Ignored,
        }
    }
}

/// Which object the parser is in: only these levels are followed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Level {
    /// At the root, or in a root array whose elements are documents.
    Outside,
    /// In a document.
    Doc,
    /// In a document's `response` object (OpenAI's Responses API) or
    /// `message` object (Anthropic's `message_start`), which carry the
    /// call's usage and model in a stream.
    Response,
}

/// An interesting value, and how to read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    /// OpenAI's `usage`.
    Usage,
    /// Gemini's `usageMetadata`.
    Gemini,
    /// Ollama's `prompt_eval_count`.
    Input,
    /// Ollama's `eval_count`.
    Output,
    /// `model` or `modelVersion`.
    Model,
    /// Ollama's `done`, or the event `type` of the Responses API
    /// (`response.completed`) or Anthropic's (`message_stop`): whether the
    /// answer says it is complete.
    Done,
}

/// What the last key read leads to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Key {
    Other,
    Response,
    Read(Target),
}

/// Where the parser is in the JSON grammar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Expecting a value.
    Value,
    /// Expecting a key (or the end of an object).
    Key,
    /// In a key's string.
    InKey { escape: bool },
    /// Expecting the `:` after a key.
    Colon,
    /// Expecting `,` or the end of a container.
    Next,
    /// In a value that is skipped, or kept if `Parser::target` says so.
    Scan(Scan),
    /// The document ended, or was not JSON: the rest is ignored.
    Stopped,
}

/// Walks over one value without understanding it: only strings and nesting matter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Scan {
    depth: usize,
    in_string: bool,
    escape: bool,
}

/// What a byte did to a scanned value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// The value goes on.
    More,
    /// The byte ended the value and belongs to it.
    Last,
    /// The value (a number or literal) ended before the byte.
    Before,
}

impl Scan {
    fn step(&mut self, b: u8) -> Step {
        if self.in_string {
            if self.escape {
                self.escape = false;
            } else if b == b'\\' {
                self.escape = true;
            } else if b == b'"' {
                self.in_string = false;
                if self.depth == 0 {
                    return Step::Last;
                }
            }
            return Step::More;
        }
        match b {
            b'"' => self.in_string = true,
            b'{' | b'[' => self.depth = self.depth.saturating_add(1),
            b'}' | b']' if self.depth == 0 => return Step::Before,
            b'}' | b']' => {
                self.depth -= 1;
                if self.depth == 0 {
                    return Step::Last;
                }
            }
            b',' | b':' if self.depth == 0 => return Step::Before,
            _ if self.depth == 0 && is_space(b) => return Step::Before,
            _ => {}
        }
        Step::More
    }

    /// How many of `bytes` can't change this scan, so need no look.
    fn skippable(&self, bytes: &[u8]) -> usize {
        if self.escape || (self.depth == 0 && !self.in_string) {
            return 0;
        }
        let special: fn(&u8) -> bool = if self.in_string {
            |&b| matches!(b, b'"' | b'\\' | b'\n' | b'\r')
        } else {
            |&b| matches!(b, b'"' | b'{' | b'}' | b'[' | b']' | b'\n' | b'\r')
        };
        bytes.iter().position(special).unwrap_or(bytes.len())
    }
}

/// The incremental JSON machine; it follows one JSON text (or one line's).
struct Parser {
    state: State,
    level: Level,
    /// Whether the root may be an array of documents (Json framing only).
    arrays: bool,
    /// In a root array, whose object elements are documents.
    array: bool,
    key: Key,
    /// The value being kept, if any.
    target: Option<Target>,
    key_buf: Vec<u8>,
    value_buf: Vec<u8>,
    /// The document said the answer is complete.
    said_done: bool,
}

impl Parser {
    fn new(arrays: bool) -> Self {
        Self {
            arrays,
            state: State::Value,
            level: Level::Outside,
            array: false,
            key: Key::Other,
            target: None,
            key_buf: Vec::new(),
            value_buf: Vec::new(),
            said_done: false,
        }
    }

    /// Starts over for a new document, keeping the buffers' memory.
    fn reset(&mut self) {
        self.stop();
        self.state = State::Value;
        self.level = Level::Outside;
        self.array = false;
        self.key = Key::Other;
        self.said_done = false;
    }

    fn stop(&mut self) {
        self.state = State::Stopped;
        self.target = None;
        self.value_buf.clear();
    }

    /// How many of `bytes` can be skipped without a look: in a skipped value,
    /// or after the end, up to the next line (which may start a document).
    fn skippable(&self, bytes: &[u8]) -> usize {
        match self.state {
            State::Scan(scan) if self.target.is_none() => scan.skippable(bytes),
            State::Stopped => (bytes.iter())
                .position(|&b| b == b'\n' || b == b'\r')
                .unwrap_or(bytes.len()),
            _ => 0,
        }
    }

    fn byte(&mut self, b: u8, read: &mut Read) {
        if let State::Scan(scan) = &mut self.state {
            let step = scan.step(b);
            if step != Step::Before {
                self.keep(b);
            }
            if step == Step::More {
                return;
            }
            self.end_value(read);
            if step == Step::Last {
                return;
            }
            // A number or literal ends at the next byte, which is structure.
        }
        self.structure(b);
    }

    fn structure(&mut self, b: u8) {
        match self.state {
            State::Stopped | State::Scan(_) => {}
            State::InKey { escape } => self.key_byte(b, escape),
            _ if is_space(b) => {}
            State::Value => self.value_start(b),
            State::Key if b == b'"' => {
                self.key_buf.clear();
                self.state = State::InKey { escape: false };
            }
            State::Colon if b == b':' => self.state = State::Value,
            State::Next if b == b',' => {
                let in_object = self.level != Level::Outside;
                self.state = if in_object { State::Key } else { State::Value };
            }
            State::Key | State::Next if b == b'}' || b == b']' => self.close(b),
            State::Key | State::Colon | State::Next => self.stop(),
        }
    }

    fn key_byte(&mut self, b: u8, escape: bool) {
        if b == b'"' && !escape {
            self.key = classify(self.level, &self.key_buf);
            self.state = State::Colon;
            return;
        }
        // A cut key is kept cut: it is too long to match anyway.
        push_capped(&mut self.key_buf, b, KEY_CAP);
        self.state = State::InKey {
            escape: !escape && b == b'\\',
        };
    }

    fn value_start(&mut self, b: u8) {
        match (self.level, self.key, b) {
            (Level::Outside, _, b'{') | (Level::Doc, Key::Response, b'{') => {
                self.level = if self.level == Level::Outside {
                    Level::Doc
                } else {
                    Level::Response
                };
                self.state = State::Key;
            }
            (Level::Outside, _, b'[') if self.arrays && !self.array => self.array = true,
            (Level::Outside, _, b']') if self.array => self.close(b),
            (Level::Outside, _, _) if !self.array => self.stop(),
            _ => self.scan(b),
        }
    }

    /// Starts walking over a value, keeping it if it is at an interesting path.
    fn scan(&mut self, b: u8) {
        if !matches!(b, b'{' | b'[' | b'"' | b'-' | b'0'..=b'9' | b't' | b'f' | b'n') {
            return self.stop();
        }
        self.target = match (self.level, self.key) {
            (Level::Doc | Level::Response, Key::Read(target)) => Some(target),
            _ => None,
        };
        self.value_buf.clear();
        let mut scan = Scan::default();
        scan.step(b);
        self.keep(b);
        self.state = State::Scan(scan);
    }

    /// Keeps a byte of an interesting value; one too long is dropped.
    fn keep(&mut self, b: u8) {
        if self.target.is_some() && !push_capped(&mut self.value_buf, b, VALUE_CAP) {
            self.target = None;
            self.value_buf.clear();
        }
    }

    fn end_value(&mut self, read: &mut Read) {
        if let Some(target) = self.target.take() {
            if target == Target::Done {
                self.said_done |= matches!(
                    &self.value_buf[..],
                    b"true" | b"\"response.completed\"" | b"\"message_stop\""
                );
            } else {
                apply(target, &self.value_buf, read);
            }
        }
        self.value_buf.clear();
        self.state = State::Next;
    }

    /// Leaves the current container if `b` is its closer; else the text is not JSON.
    fn close(&mut self, b: u8) {
        let (closer, outer) = match self.level {
            Level::Response => (b'}', Level::Doc),
            Level::Doc => (b'}', Level::Outside),
            Level::Outside if self.array => {
                self.array = false;
                (b']', Level::Outside)
            }
            Level::Outside => return self.stop(),
        };
        if b != closer {
            return self.stop();
        }
        self.level = outer;
        self.state = if outer == Level::Outside && !self.array {
            State::Stopped
        } else {
            State::Next
        };
    }
}

/// Tells what a key leads to, from the level it is at.
fn classify(level: Level, key: &[u8]) -> Key {
    match (level, key) {
        (Level::Doc, b"response" | b"message") => Key::Response,
        (Level::Doc | Level::Response, b"usage") => Key::Read(Target::Usage),
        (Level::Doc | Level::Response, b"model") => Key::Read(Target::Model),
        (Level::Doc, b"modelVersion") => Key::Read(Target::Model),
        (Level::Doc, b"usageMetadata") => Key::Read(Target::Gemini),
        (Level::Doc, b"prompt_eval_count") => Key::Read(Target::Input),
        (Level::Doc, b"eval_count") => Key::Read(Target::Output),
        (Level::Doc, b"done" | b"type") => Key::Read(Target::Done),
        _ => Key::Other,
    }
}

/// Reads a kept value into `read`; one that isn't what is expected changes nothing.
fn apply(target: Target, raw: &[u8], read: &mut Read) {
    let Ok(value) = serde_json::from_slice::<Value>(raw) else {
        return;
    };
    let field = |name: &str| count(value.get(name));
    let set = |slot: &mut Option<i64>, n: Option<i64>| {
        if n.is_some() {
            *slot = n;
        }
    };
    match target {
        Target::Usage => {
            set(
                &mut read.input_tokens,
                field("prompt_tokens").or_else(|| field("input_tokens")),
            );
            set(
                &mut read.output_tokens,
                field("completion_tokens").or_else(|| field("output_tokens")),
            );
        }
        Target::Gemini => {
            set(&mut read.input_tokens, field("promptTokenCount"));
            let (candidates, thoughts) = (field("candidatesTokenCount"), field("thoughtsTokenCount"));
            if candidates.is_some() || thoughts.is_some() {
                let sum = candidates.unwrap_or(0).checked_add(thoughts.unwrap_or(0));
                set(&mut read.output_tokens, sum);
            }
        }
        Target::Input => set(&mut read.input_tokens, count(Some(&value))),
        Target::Output => set(&mut read.output_tokens, count(Some(&value))),
        Target::Model => {
            if let Value::String(model) = value {
                read.model = Some(model);
            }
        }
        Target::Done => {}
    }
}

/// A token count: a whole non-negative number that fits in `i64`.
fn count(value: Option<&Value>) -> Option<i64> {
    value?.as_u64().and_then(|n| i64::try_from(n).ok())
}

/// Pushes `b` unless `buf` holds `cap` bytes already; grows it to `cap` at most.
fn push_capped(buf: &mut Vec<u8>, b: u8, cap: usize) -> bool {
    if buf.len() >= cap {
        return false;
    }
    if buf.len() == buf.capacity() {
        let wanted = cap.min(buf.capacity().saturating_mul(2).max(16));
        buf.reserve_exact(wanted.saturating_sub(buf.len()));
    }
    buf.push(b);
    true
}

fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A realistic answer of one shape, and what must be read from it.
    struct Sample {
        name: &'static str,
        content_type: &'static str,
        body: &'static str,
        expected: (Option<i64>, Option<i64>, Option<&'static str>),
    }

    const OPENAI_CHAT: &str = r#"{"id":"chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT","object":"chat.completion","created":1741569952,"model":"gpt-4.1-2025-04-14","choices":[{"index":0,"message":{"role":"assistant","content":"Hello! \"usage\":{\"prompt_tokens\":99} {[}] \\ caf\u00e9 — naïve 日本","refusal":null,"annotations":[]},"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":19,"completion_tokens":10,"total_tokens":29,"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":0},"completion_tokens_details":{"reasoning_tokens":0,"audio_tokens":0,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}},"service_tier":"default","system_fingerprint":"fp_b705f0c291"}"#;

    const OPENAI_CHAT_STREAM: &str = concat!(
        "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1694268190,\"model\":\"gpt-4o-mini-2024-07-18\",\"system_fingerprint\":\"fp_44709d6fcb\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n",
        "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1694268190,\"model\":\"gpt-4o-mini-2024-07-18\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi \\\"there\\\" {\"},\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n",
        "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1694268190,\"model\":\"gpt-4o-mini-2024-07-18\",\"choices\":[{\"index\":0,\"delta\":{},\"logprobs\":null,\"finish_reason\":\"stop\"}],\"usage\":null}\n\n",
        "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1694268190,\"model\":\"gpt-4o-mini-2024-07-18\",\"choices\":[],\"usage\":{\"prompt_tokens\":17,\"completion_tokens\":4,\"total_tokens\":21,\"prompt_tokens_details\":{\"cached_tokens\":0},\"completion_tokens_details\":{\"reasoning_tokens\":0}}}\n\n",
        "data: [DONE]\n\n",
    );

    const OPENAI_EMBEDDINGS: &str = r#"{
  "object": "list",
  "data": [
    {
      "object": "embedding",
      "index": 0,
      "embedding": [-0.006929283, -0.005336422, 1e-05, 0.0, -4.547132E-3]
    }
  ],
  "model": "text-embedding-3-small",
  "usage": {
    "prompt_tokens": 5,
    "total_tokens": 5
  }
}
"#;

    const OPENAI_RESPONSES_STREAM: &str = concat!(
        "event: response.created\n",
        "data: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_67c9\",\"object\":\"response\",\"created_at\":1741290958,\"status\":\"in_progress\",\"model\":\"gpt-4.1-2025-04-14\",\"output\":[],\"usage\":null,\"metadata\":{}}}\n\n",
        "event: response.output_text.delta\n",
        "data: {\"type\":\"response.output_text.delta\",\"sequence_number\":4,\"item_id\":\"msg_67c9\",\"output_index\":0,\"content_index\":0,\"delta\":\"Hi\"}\n\n",
        "event: response.completed\n",
        "data: {\"type\":\"response.completed\",\"sequence_number\":9,\"response\":{\"id\":\"resp_67c9\",\"object\":\"response\",\"created_at\":1741290958,\"status\":\"completed\",\"model\":\"gpt-4.1-2025-04-14\",\"output\":[{\"id\":\"msg_67c9\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[{\"type\":\"output_text\",\"text\":\"Hi\",\"annotations\":[]}]}],\"usage\":{\"input_tokens\":37,\"input_tokens_details\":{\"cached_tokens\":0},\"output_tokens\":11,\"output_tokens_details\":{\"reasoning_tokens\":0},\"total_tokens\":48},\"metadata\":{}}}\n\n",
    );

    const OLLAMA_CHAT: &str = r#"{"model":"llama3.2","created_at":"2023-12-12T14:13:43.416799Z","message":{"role":"assistant","content":"Hello! How are you today?"},"done":true,"done_reason":"stop","total_duration":5191566416,"load_duration":2154458,"prompt_eval_count":26,"prompt_eval_duration":383809000,"eval_count":298,"eval_duration":4799921000}"#;

    const OLLAMA_CHAT_STREAM: &str = concat!(
        "{\"model\":\"llama3.2\",\"created_at\":\"2023-08-04T08:52:19.385406455-07:00\",\"message\":{\"role\":\"assistant\",\"content\":\"The\"},\"done\":false}\n",
        "{\"model\":\"llama3.2\",\"created_at\":\"2023-08-04T08:52:19.41Z\",\"message\":{\"role\":\"assistant\",\"content\":\" sky {is\\\"\"},\"done\":false}\n",
        "{\"model\":\"llama3.2\",\"created_at\":\"2023-08-04T19:22:45.499127Z\",\"message\":{\"role\":\"assistant\",\"content\":\"\"},\"done\":true,\"done_reason\":\"stop\",\"total_duration\":4883583458,\"load_duration\":1334875,\"prompt_eval_count\":26,\"prompt_eval_duration\":342546000,\"eval_count\":282,\"eval_duration\":4535599000}\n",
    );

    const OLLAMA_EMBED: &str = r#"{"model":"all-minilm","embeddings":[[0.010071029,-0.0017594862,0.05007221,0.04692972,0.054916814]],"total_duration":14143917,"load_duration":1019500,"prompt_eval_count":8}"#;

    const GEMINI: &str = r#"{
  "candidates": [
    {
      "content": {
        "parts": [{"text": "Hi! \"usageMetadata\": {\"promptTokenCount\": 1}"}],
        "role": "model"
      },
      "finishReason": "STOP",
      "index": 0
    }
  ],
  "usageMetadata": {
    "promptTokenCount": 4,
    "candidatesTokenCount": 11,
    "totalTokenCount": 35,
    "promptTokensDetails": [{"modality": "TEXT", "tokenCount": 4}],
    "thoughtsTokenCount": 20
  },
  "modelVersion": "gemini-2.5-flash",
  "responseId": "Lk9TaN2bE4-Dz7IP5dmz0Qs"
}
"#;

    const GEMINI_SSE: &str = concat!(
        "data: {\"candidates\": [{\"content\": {\"parts\": [{\"text\": \"The\"}],\"role\": \"model\"},\"index\": 0}],\"usageMetadata\": {\"promptTokenCount\": 9,\"candidatesTokenCount\": 1,\"totalTokenCount\": 10},\"modelVersion\": \"gemini-2.0-flash\",\"responseId\": \"a1\"}\r\n\r\n",
        "data: {\"candidates\": [{\"content\": {\"parts\": [{\"text\": \" sky is blue\"}],\"role\": \"model\"},\"finishReason\": \"STOP\",\"index\": 0}],\"usageMetadata\": {\"promptTokenCount\": 9,\"candidatesTokenCount\": 12,\"totalTokenCount\": 30,\"thoughtsTokenCount\": 9},\"modelVersion\": \"gemini-2.0-flash-001\",\"responseId\": \"a1\"}\r\n\r\n",
    );

    const GEMINI_ARRAY: &str = concat!(
        "[{\"candidates\": [{\"content\": {\"parts\": [{\"text\": \"The\"}],\"role\": \"model\"},\"index\": 0}],\"usageMetadata\": {\"promptTokenCount\": 9,\"candidatesTokenCount\": 1,\"totalTokenCount\": 10},\"modelVersion\": \"gemini-2.0-flash\"}\r\n",
        ",\r\n{\"candidates\": [{\"content\": {\"parts\": [{\"text\": \" sky ]}\"}],\"role\": \"model\"},\"index\": 0}],\"usageMetadata\": {\"promptTokenCount\": 9,\"candidatesTokenCount\": 5,\"totalTokenCount\": 14},\"modelVersion\": \"gemini-2.0-flash\"}\r\n",
        ",\r\n{\"candidates\": [{\"content\": {\"parts\": [{\"text\": \"\"}],\"role\": \"model\"},\"finishReason\": \"STOP\",\"index\": 0}],\"usageMetadata\": {\"promptTokenCount\": 9,\"candidatesTokenCount\": 12,\"totalTokenCount\": 21},\"modelVersion\": \"gemini-2.0-flash-001\"}\r\n",
        "]",
    );

    const SAMPLES: [Sample; 10] = [
        Sample {
            name: "openai chat",
            content_type: "application/json",
            body: OPENAI_CHAT,
            expected: (Some(19), Some(10), Some("gpt-4.1-2025-04-14")),
        },
        Sample {
            name: "openai chat stream",
            content_type: "text/event-stream; charset=utf-8",
            body: OPENAI_CHAT_STREAM,
            expected: (Some(17), Some(4), Some("gpt-4o-mini-2024-07-18")),
        },
        Sample {
            name: "openai embeddings",
            content_type: "application/json",
            body: OPENAI_EMBEDDINGS,
            expected: (Some(5), None, Some("text-embedding-3-small")),
        },
        Sample {
            name: "openai responses stream",
            content_type: "text/event-stream",
            body: OPENAI_RESPONSES_STREAM,
            expected: (Some(37), Some(11), Some("gpt-4.1-2025-04-14")),
        },
        Sample {
            name: "ollama chat",
            content_type: "application/json; charset=utf-8",
            body: OLLAMA_CHAT,
            expected: (Some(26), Some(298), Some("llama3.2")),
        },
        Sample {
            name: "ollama chat stream",
            content_type: "application/x-ndjson",
            body: OLLAMA_CHAT_STREAM,
            expected: (Some(26), Some(282), Some("llama3.2")),
        },
        Sample {
            name: "ollama embed",
            content_type: "application/json",
            body: OLLAMA_EMBED,
            expected: (Some(8), None, Some("all-minilm")),
        },
        Sample {
            name: "gemini generateContent",
            content_type: "application/json; charset=UTF-8",
            body: GEMINI,
            expected: (Some(4), Some(31), Some("gemini-2.5-flash")),
        },
        Sample {
            name: "gemini stream sse",
            content_type: "text/event-stream",
            body: GEMINI_SSE,
            expected: (Some(9), Some(21), Some("gemini-2.0-flash-001")),
        },
        Sample {
            name: "gemini stream array",
            content_type: "application/json; charset=UTF-8",
            body: GEMINI_ARRAY,
            expected: (Some(9), Some(12), Some("gemini-2.0-flash-001")),
        },
    ];

    fn read_chunks<'a>(framing: Framing, chunks: impl IntoIterator<Item = &'a [u8]>) -> Read {
        let mut reader = Reader::new(framing);
        for chunk in chunks {
            reader.feed(chunk);
        }
        reader.read()
    }

    fn read_whole(framing: Framing, body: &str) -> Read {
        read_chunks(framing, [body.as_bytes()])
    }

    fn expected(sample: &Sample) -> Read {
        let (input_tokens, output_tokens, model) = sample.expected;
        Read {
            input_tokens,
            output_tokens,
            model: model.map(str::to_owned),
        }
    }

    /// Cuts `body` at the given positions (any order, any value).
    fn split_at_many<'a>(body: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
        let mut cuts: Vec<usize> = cuts.iter().map(|&c| c % (body.len() + 1)).collect();
        cuts.sort_unstable();
        let mut chunks = Vec::new();
        let mut start = 0;
        for cut in cuts.into_iter().chain([body.len()]) {
            chunks.push(&body[start..cut]);
            start = cut;
        }
        chunks
    }

    #[test]
    fn each_sample_reads_the_same_however_split() {
        for sample in &SAMPLES {
            let framing = Framing::of(Some(sample.content_type));
            let body = sample.body.as_bytes();
            let want = expected(sample);
            assert_eq!(read_whole(framing, sample.body), want, "{}", sample.name);
            for cut in 0..=body.len() {
                let (a, b) = body.split_at(cut);
                assert_eq!(read_chunks(framing, [a, b]), want, "{} cut {cut}", sample.name);
            }
            let bytes = read_chunks(framing, body.chunks(1));
            assert_eq!(bytes, want, "{} byte by byte", sample.name);
        }
    }

    /// Whether `body` fed in chunks cut at `at` says the answer is complete.
    fn finished_when_cut(framing: Framing, body: &[u8], at: usize) -> bool {
        let mut reader = Reader::new(framing);
        reader.feed(&body[..at]);
        reader.feed(&body[at..]);
        reader.finished()
    }

    #[test]
    fn anthropic_messages_read_input_from_message_start_and_output_from_the_last_delta() {
        let stream = concat!(
            "event: message_start\n",
            "data: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",",
            "\"role\":\"assistant\",\"model\":\"claude-sonnet-4-5-20250929\",\"content\":[],",
            "\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n",
            "event: content_block_delta\n",
            "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n\n",
            "event: message_delta\n",
            "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":15}}\n\n",
            "event: message_stop\n",
            "data: {\"type\":\"message_stop\"}\n\n",
        );
        let expected = read(Some(25), Some(15), Some("claude-sonnet-4-5-20250929"));
        for at in 0..stream.len() {
            let mut reader = Reader::new(Framing::EventStream);
            reader.feed(&stream.as_bytes()[..at]);
            assert!(
                !reader.finished() || at >= stream.len() - 2,
                "finished early, cut at {at}"
            );
            reader.feed(&stream.as_bytes()[at..]);
            assert_eq!(reader.read(), expected, "cut at {at}");
            assert!(reader.finished());
        }
        let whole = concat!(
            "{\"id\":\"msg_1\",\"type\":\"message\",\"model\":\"claude-sonnet-4-5-20250929\",",
            "\"content\":[{\"type\":\"text\",\"text\":\"Hi\"}],\"usage\":{\"input_tokens\":25,\"output_tokens\":15}}"
        );
        assert_eq!(read_whole(Framing::Json, whole), expected);
    }

    #[test]
    fn an_answer_is_finished_at_the_end_of_the_line_that_says_so() {
        let done = |framing, body: &str| {
            let whole = finished_when_cut(framing, body.as_bytes(), 0);
            for at in 0..body.len() {
                assert_eq!(
                    finished_when_cut(framing, body.as_bytes(), at),
                    whole,
                    "{body:?} cut at {at}"
                );
            }
            whole
        };
        assert!(done(Framing::EventStream, "data: {\"a\":1}\n\ndata: [DONE]\n"));
        assert!(done(Framing::EventStream, "data:[DONE]\r\n"));
        assert!(
            !done(Framing::EventStream, "data: [DONE]"),
            "not before its line ends"
        );
        assert!(!done(Framing::EventStream, "data: [DONE] x\n"));
        assert!(!done(Framing::EventStream, "event: [DONE]\n"));
        assert!(!done(Framing::EventStream, "data: {\"t\":\"[DONE]\"}\n"));
        assert!(done(
            Framing::EventStream,
            "data: {\"type\":\"response.completed\",\"response\":{\"usage\":{}}}\n"
        ));
        assert!(!done(
            Framing::EventStream,
            "data: {\"type\":\"response.created\"}\n"
        ));
        assert!(done(
            Framing::Ndjson,
            "{\"done\":false}\n{\"done\":true,\"eval_count\":3}\n"
        ));
        assert!(
            !done(Framing::Ndjson, "{\"done\":true,\"eval_count\":3}"),
            "its line must end"
        );
        assert!(
            !done(Framing::Ndjson, "{\"done\":true,\"eval_count\":\n"),
            "a document cut short"
        );
        assert!(
            !done(Framing::Ndjson, "{\"message\":{\"done\":true}}\n"),
            "only at the top"
        );
        assert!(
            !done(Framing::Json, "{\"done\":true}\n"),
            "a JSON body ends with the body"
        );
    }

    #[test]
    fn framing_comes_from_the_content_type() {
        let cases = [
            (None, Framing::Json),
            (Some(""), Framing::Json),
            (Some("application/json"), Framing::Json),
            (Some("text/html"), Framing::Json),
            (Some("Text/Event-Stream; charset=utf-8"), Framing::EventStream),
            (Some(" text/event-stream "), Framing::EventStream),
            (Some("application/x-ndjson"), Framing::Ndjson),
            (Some("application/NDJSON;charset=utf-8"), Framing::Ndjson),
            (Some("application/jsonl"), Framing::Ndjson),
            (Some("application/json-lines"), Framing::Ndjson),
        ];
        for (content_type, framing) in cases {
            assert_eq!(Framing::of(content_type), framing, "{content_type:?}");
        }
    }

    fn read(input: Option<i64>, output: Option<i64>, model: Option<&str>) -> Read {
        Read {
            input_tokens: input,
            output_tokens: output,
            model: model.map(str::to_owned),
        }
    }

    #[test]
    fn decoys_are_not_read() {
        let json = |body| read_whole(Framing::Json, body);
        let string_value = r#"{"content":"\"usage\":{\"prompt_tokens\":99},\"model\":\"bad\"","model":"m"}"#;
        assert_eq!(json(string_value), read(None, None, Some("m")));
        let in_choices = r#"{"choices":[{"message":{"usage":{"prompt_tokens":1,"completion_tokens":2}},"usage":{"prompt_tokens":3}}],"model":"m"}"#;
        assert_eq!(json(in_choices), read(None, None, Some("m")));
        let in_messages = r#"{"messages":[{"role":"user","model":"bad"}],"data":[{"model":"x"}],"meta":{"model":"y","usage":{"prompt_tokens":7}}}"#;
        assert_eq!(json(in_messages), Read::default());
        let deep_response = r#"{"x":{"response":{"usage":{"input_tokens":1}}},"response":{"meta":{"model":"bad"},"prompt_eval_count":4}}"#;
        assert_eq!(json(deep_response), Read::default());
        let key_as_value =
            r#"{"name":"usage","value":"model","array":["usage",{"usage":{"prompt_tokens":1}}]}"#;
        assert_eq!(json(key_as_value), Read::default());
    }

    #[test]
    fn event_stream_lines_are_framed_like_the_spec_says() {
        let sse = |body| read_whole(Framing::EventStream, body);
        let crlf = "event: x\r\nid: 1\r\n: comment {\"model\":\"bad\"}\r\ndata: {\"model\":\"m\",\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}\r\n\r\ndata: [DONE]\r\n\r\n";
        assert_eq!(sse(crlf), read(Some(1), Some(2), Some("m")));
        let cr = "data: {\"model\":\"a\"}\rdata: {\"usage\":{\"prompt_tokens\":3}}\r";
        assert_eq!(sse(cr), read(Some(3), None, Some("a")));
        let no_space = "data:{\"model\":\"m\",\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}\n";
        assert_eq!(sse(no_space), read(Some(1), Some(2), Some("m")));
        let not_data =
            "event: {\"model\":\"bad\"}\ndatum: {\"model\":\"bad\"}\ndata {\"model\":\"bad\"}\nretry: 10\n";
        assert_eq!(sse(not_data), Read::default());
        let two_spaces = "data:  {\"model\":\"m\"}\n";
        assert_eq!(sse(two_spaces), read(None, None, Some("m")));
    }

    #[test]
    fn usage_null_changes_nothing_and_the_last_value_wins() {
        let body = "data: {\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2},\"model\":\"a\"}\n\ndata: {\"usage\":null,\"model\":\"b\"}\n\ndata: {\"usage\":{\"prompt_tokens\":5},\"model\":7}\n\n";
        let got = read_whole(Framing::EventStream, body);
        assert_eq!(got, read(Some(5), Some(2), Some("b")));
    }

    #[test]
    fn bad_token_counts_are_ignored() {
        for bad in [
            "-1",
            "1.5",
            "\"7\"",
            "1e3",
            "9223372036854775808",
            "1e400",
            "null",
            "true",
            "[1]",
            "{}",
        ] {
            let body = format!(
                r#"{{"prompt_eval_count":{bad},"eval_count":{bad},"usage":{{"prompt_tokens":{bad},"output_tokens":{bad}}}}}"#
            );
            assert_eq!(read_whole(Framing::Json, &body), Read::default(), "{bad}");
        }
        let max = r#"{"prompt_eval_count":9223372036854775807,"eval_count":0}"#;
        assert_eq!(
            read_whole(Framing::Json, max),
            read(Some(i64::MAX), Some(0), None)
        );
        let overflow =
            r#"{"usageMetadata":{"candidatesTokenCount":9223372036854775807,"thoughtsTokenCount":1}}"#;
        assert_eq!(read_whole(Framing::Json, overflow), Read::default());
    }

    #[test]
    fn gemini_output_counts_thoughts_and_keeps_old_when_both_absent() {
        let body = concat!(
            "data: {\"usageMetadata\":{\"promptTokenCount\":3,\"candidatesTokenCount\":4}}\n",
            "data: {\"usageMetadata\":{\"promptTokenCount\":5}}\n",
        );
        assert_eq!(
            read_whole(Framing::EventStream, body),
            read(Some(5), Some(4), None)
        );
        let thoughts = r#"{"usageMetadata":{"thoughtsTokenCount":6}}"#;
        assert_eq!(read_whole(Framing::Json, thoughts), read(None, Some(6), None));
    }

    #[test]
    fn garbage_lines_are_skipped_until_the_next_line() {
        let body = "{\"model\":\"a\"}\nnot json {\"model\":\"bad\"}\n{\"model\" \"bad\", \"eval_count\":1}\n{\"x\":[}],\"model\":\"bad\"}\n<html>\n{\"eval_count\":3}\n";
        assert_eq!(read_whole(Framing::Ndjson, body), read(None, Some(3), Some("a")));
        // A line cut inside a string: the next line starts afresh.
        let cut = "{\"model\":\"a\",\"x\":\"unterminated\n{\"model\":\"b\"}";
        assert_eq!(read_whole(Framing::Ndjson, cut), read(None, None, Some("b")));
    }

    #[test]
    fn json_framing_stops_once_the_body_is_not_json() {
        let json = |body| read_whole(Framing::Json, body);
        assert_eq!(json("<html>{\"model\":\"bad\"}</html>"), Read::default());
        assert_eq!(
            json("{\"model\":\"a\"} {\"model\":\"b\"}"),
            read(None, None, Some("a"))
        );
        assert_eq!(
            json("{\"model\":\"a\"]{\"model\":\"b\"}"),
            read(None, None, Some("a"))
        );
        assert_eq!(json("\"model\" {\"model\":\"b\"}"), Read::default());
        assert_eq!(
            json("[1, \"x\", {\"model\":\"a\"}, [{\"model\":\"bad\"}]]"),
            read(None, None, Some("a"))
        );
        // An element after a document is not read as the document's last key's value.
        let after = "[{\"usage\":{\"prompt_tokens\":1},\"model\":\"a\"}, \"b\", {\"eval_count\":2}, 3]";
        assert_eq!(json(after), read(Some(1), Some(2), Some("a")));
    }

    #[test]
    fn escaped_keys_and_long_keys_do_not_match() {
        let long_key = "k".repeat(1000);
        let body = format!(r#"{{"{long_key}":{{"model":"bad"}},"mod\"el":"bad","model":"m"}}"#);
        assert_eq!(read_whole(Framing::Json, &body), read(None, None, Some("m")));
        let escaped = r#"{"model":"caf\u00e9 \"x\""}"#;
        assert_eq!(
            read_whole(Framing::Json, escaped),
            read(None, None, Some("café \"x\""))
        );
    }

    #[test]
    fn an_interesting_value_past_its_cap_is_dropped_but_reading_goes_on() {
        let mut reader = Reader::new(Framing::Json);
        reader.feed(br#"{"model":"a","usage":{"padding":""#);
        for _ in 0..100 {
            reader.feed(&[b'x'; 1024]);
        }
        reader.feed(br#"","prompt_tokens":1},"model":""#);
        reader.feed(&[b'y'; VALUE_CAP]);
        reader.feed(br#"","eval_count":2}"#);
        assert_eq!(reader.read(), read(None, Some(2), Some("a")));
        assert_eq!(reader.buffer_capacities(), (16, VALUE_CAP));
    }

    #[test]
    fn a_huge_embedding_answer_is_read_with_bounded_memory() {
        let mut reader = Reader::new(Framing::Json);
        reader.feed(br#"{"object":"list","data":[{"object":"embedding","index":0,"embedding":["#);
        let block = "0.015625,-0.5,".repeat(64 * 1024 / 14);
        let mut fed = 0;
        while fed < 50 * 1024 * 1024 {
            reader.feed(block.as_bytes());
            fed += block.len();
        }
        reader.feed(
            br#"0.25]}],"model":"text-embedding-3-large","usage":{"prompt_tokens":5,"total_tokens":5}}"#,
        );
        let got = reader.read();
        assert_eq!(got, read(Some(5), None, Some("text-embedding-3-large")));
        let (key, value) = reader.buffer_capacities();
        assert!(key <= KEY_CAP && value <= VALUE_CAP, "{key} {value}");
    }

    #[test]
    fn a_huge_ndjson_line_is_read_with_bounded_memory() {
        let mut reader = Reader::new(Framing::Ndjson);
        reader.feed(br#"{"model":"all-minilm","embeddings":[["#);
        let block = "0.125,".repeat(64 * 1024 / 6);
        for _ in 0..80 {
            reader.feed(block.as_bytes());
        }
        reader.feed(b"1]],\"prompt_eval_count\":8}\n");
        assert_eq!(reader.read(), read(Some(8), None, Some("all-minilm")));
        let (key, value) = reader.buffer_capacities();
        assert!(key <= KEY_CAP && value <= VALUE_CAP, "{key} {value}");
    }

    fn any_framing() -> impl Strategy<Value = Framing> {
        prop_oneof![
            Just(Framing::Json),
            Just(Framing::EventStream),
            Just(Framing::Ndjson)
        ]
    }

    /// Keys that matter somewhere, and decoys that look like JSON structure.
    const KEYS: [&str; 16] = [
        "usage",
        "model",
        "modelVersion",
        "response",
        "usageMetadata",
        "prompt_eval_count",
        "eval_count",
        "prompt_tokens",
        "completion_tokens",
        "input_tokens",
        "output_tokens",
        "promptTokenCount",
        "candidatesTokenCount",
        "thoughtsTokenCount",
        "x\\\"{[",
        "data",
    ];

    /// An object of the given key-value pairs.
    fn object(
        pairs: impl Strategy<Value = (&'static str, Value)> + 'static,
        max: usize,
    ) -> BoxedStrategy<Value> {
        prop::collection::vec(pairs, 0..max)
            .prop_map(|pairs| {
                let map = pairs.into_iter().map(|(k, v)| (k.to_owned(), v));
                Value::Object(map.collect())
            })
            .boxed()
    }

    fn any_key() -> impl Strategy<Value = &'static str> + Clone {
        prop::sample::select(KEYS.to_vec())
    }

    fn any_json() -> impl Strategy<Value = Value> + Clone {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            (0..100i64).prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            any_key().prop_map(Value::from),
            "\\PC{0,8}".prop_map(Value::from),
        ];
        leaf.prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
                object((any_key(), inner), 6),
            ]
        })
    }

    /// A document likely to hold token counts and models at the paths read, and near them.
    fn any_doc() -> impl Strategy<Value = Value> {
        let small = prop_oneof![3 => (0..100i64).prop_map(Value::from), 1 => any_json()];
        let name = prop_oneof!["[a-z]{1,3}".prop_map(Value::from), any_json()];
        let select = |keys: &[&'static str]| prop::sample::select(keys.to_vec());
        let pair = prop_oneof![
            (select(&["model", "modelVersion"]), name),
            (
                select(&["usage", "usageMetadata"]),
                object((any_key(), small.clone()), 6)
            ),
            (select(&["prompt_eval_count", "eval_count"]), small),
            (any_key(), any_json()),
        ];
        let response = (Just("response"), object(pair.clone(), 6));
        prop_oneof![1 => any_json(), 4 => object(prop_oneof![3 => pair, 1 => response], 6)]
    }

    /// What must be read from whole documents, walked with `serde_json`.
    fn reference(docs: &[Value]) -> Read {
        let mut read = Read::default();
        let mut take = |target, value: &Value| {
            let raw = serde_json::to_vec(value).unwrap();
            apply(target, &raw, &mut read);
        };
        for doc in docs.iter().filter_map(Value::as_object) {
            for (key, value) in doc {
                match (key.as_str(), value.as_object()) {
                    ("response", Some(response)) => {
                        for (key, value) in response {
                            match key.as_str() {
                                "usage" => take(Target::Usage, value),
                                "model" => take(Target::Model, value),
                                _ => {}
                            }
                        }
                    }
                    _ => match classify(Level::Doc, key.as_bytes()) {
                        Key::Read(target) => take(target, value),
                        Key::Response | Key::Other => {}
                    },
                }
            }
        }
        read
    }

    proptest! {
        #[test]
        fn any_split_of_a_sample_reads_like_the_whole(
            index in 0..SAMPLES.len(),
            cuts in prop::collection::vec(any::<usize>(), 0..64),
        ) {
            let sample = &SAMPLES[index];
            let framing = Framing::of(Some(sample.content_type));
            let chunks = split_at_many(sample.body.as_bytes(), &cuts);
            prop_assert_eq!(read_chunks(framing, chunks), expected(sample));
        }

        #[test]
        fn arbitrary_documents_read_like_a_full_parse(
            docs in prop::collection::vec(any_doc(), 1..4),
            cuts in prop::collection::vec(any::<usize>(), 0..16),
        ) {
            let want = reference(&docs);
            let lines: Vec<String> = docs.iter().map(Value::to_string).collect();
            let bodies = [
                (Framing::Json, serde_json::to_string_pretty(&docs).unwrap()),
                (Framing::EventStream, lines.iter().map(|l| format!("data: {l}\r\n\r\n")).collect()),
                (Framing::Ndjson, lines.iter().map(|l| format!("{l}\n")).collect()),
            ];
            for (framing, body) in bodies {
                let chunks = split_at_many(body.as_bytes(), &cuts);
                prop_assert_eq!(read_chunks(framing, chunks), want.clone(), "{:?} {}", framing, body);
            }
            if docs[0].is_object() {
                let single = read_whole(Framing::Json, &docs[0].to_string());
                prop_assert_eq!(single, reference(&docs[..1]));
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(
            framing in any_framing(),
            body in prop::collection::vec(any::<u8>(), 0..4096),
            cuts in prop::collection::vec(any::<usize>(), 0..16),
        ) {
            let chunks = split_at_many(&body, &cuts);
            let mut reader = Reader::new(framing);
            for chunk in chunks {
                reader.feed(chunk);
            }
            let (key, value) = reader.buffer_capacities();
            prop_assert!(key <= KEY_CAP && value <= VALUE_CAP);
            let _ = reader.read();
        }

        #[test]
        fn mutated_samples_never_panic(
            framing in any_framing(),
            index in 0..SAMPLES.len(),
            edits in prop::collection::vec((any::<usize>(), any::<u8>(), 0..3u8), 1..16),
            cuts in prop::collection::vec(any::<usize>(), 0..16),
        ) {
            let mut body = SAMPLES[index].body.as_bytes().to_vec();
            for (at, byte, kind) in edits {
                let at = at % (body.len() + 1);
                match kind {
                    0 => body.insert(at, byte),
                    1 if at < body.len() => { body.remove(at); }
                    _ if at < body.len() => body[at] = byte,
                    _ => body.push(byte),
                }
            }
            let mut reader = Reader::new(framing);
            for chunk in split_at_many(&body, &cuts) {
                reader.feed(chunk);
            }
            let _ = reader.read();
        }
    }
}
