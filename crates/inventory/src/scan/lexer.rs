//! A small tokenizer shared by the language scanners: it drops comments and turns string, char
//! and regex literals into single tokens, so that keywords are only ever found in real code.
//!
//! It is deliberately not a parser: it knows each language's comment and literal syntax (nested
//! Rust block comments, raw strings, char-vs-lifetime, Python prefixes and triple quotes, Go raw
//! strings, JavaScript template literals with `${…}` and regex literals, Java text blocks) and
//! nothing else. Single-line string kinds end at an unescaped newline, which confines the damage a
//! stray quote (for example an apostrophe in JSX text) can do to one line.

/// Which syntax to tokenize.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lang {
    Rust,
    Go,
    Python,
    Js,
    Java,
}

/// What a token is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Tok {
    /// An identifier or keyword; its text is the token's `text`.
    Ident,
    /// One punctuation byte (multi-byte operators come as several tokens).
    Punct(u8),
    /// A string literal with its (lightly) unescaped value; for a JavaScript template literal the
    /// raw text between the backticks.
    Str(String),
    /// A numeric literal.
    Number,
    /// A char/rune literal.
    Char,
    /// A JavaScript regex literal.
    Regex,
}

/// A token with its place in the source.
#[derive(Debug, Clone)]
pub(crate) struct Token<'s> {
    pub(crate) kind: Tok,
    /// The exact source text of the token.
    pub(crate) text: &'s str,
    /// Byte offset of the token's first byte.
    pub(crate) start: usize,
    /// 1-based line of the token's first byte.
    pub(crate) line: u32,
    /// For the first token of a physical line: its visual column (tabs to multiples of 8).
    pub(crate) indent: Option<u32>,
}

impl Token<'_> {
    /// Whether this is the identifier `word`.
    pub(crate) fn is_ident(&self, word: &str) -> bool {
        self.kind == Tok::Ident && self.text == word
    }

    /// Whether this is the punctuation byte `c`.
    pub(crate) fn is_punct(&self, c: u8) -> bool {
        self.kind == Tok::Punct(c)
    }

    /// The string value if this is a string literal.
    pub(crate) fn str_value(&self) -> Option<&str> {
        match &self.kind {
            Tok::Str(v) => Some(v),
            _ => None,
        }
    }
}

/// Tokenizes `src` according to `lang`.
pub(crate) fn lex(src: &str, lang: Lang) -> Vec<Token<'_>> {
    Lexer {
        src,
        b: src.as_bytes(),
        lang,
        i: 0,
        line: 1,
        line_start: 0,
        first_on_line: true,
        no_regex_before: 0,
        failed_regex_scans: 0,
        out: Vec::new(),
    }
    .run()
}

struct Lexer<'s> {
    src: &'s str,
    b: &'s [u8],
    lang: Lang,
    i: usize,
    line: u32,
    line_start: usize,
    first_on_line: bool,
    /// A `/` before this offset is never read as a regex: [`MAX_FAILED_REGEX_SCANS`] regex scans
    /// on the line found no end before it. Trying again from every `/` of the line would take
    /// time growing with the square of the line (`[/[/[/…`).
    no_regex_before: usize,
    /// Regex scans that found no end since the last line break.
    failed_regex_scans: u32,
    out: Vec<Token<'s>>,
}

/// A dotted name (`org.junit.Test`, `pytest.mark.skip`) from the start of `toks`, and how many
/// tokens it spans (names and dots alternate; anything else ends it).
pub(crate) fn dotted_span(toks: &[Token<'_>]) -> (String, usize) {
    let mut out = String::new();
    let mut width = 0;
    while let Some(t) = toks.get(width) {
        let want_ident = width % 2 == 0;
        match t.kind {
            Tok::Ident if want_ident => out.push_str(t.text),
            Tok::Punct(b'.') if !want_ident => out.push('.'),
            _ => break,
        }
        width += 1;
    }
    (out, width)
}

/// The dotted name at the start of `toks` (see [`dotted_span`]).
pub(crate) fn dotted_name(toks: &[Token<'_>]) -> String {
    dotted_span(toks).0
}

fn is_ident_start(c: u8, lang: Lang) -> bool {
    c.is_ascii_alphabetic() || c == b'_' || c >= 0x80 || (c == b'$' && dollar_ident(lang))
}

fn is_ident_continue(c: u8, lang: Lang) -> bool {
    c.is_ascii_alphanumeric() || c == b'_' || c >= 0x80 || (c == b'$' && dollar_ident(lang))
}

fn dollar_ident(lang: Lang) -> bool {
    matches!(lang, Lang::Js | Lang::Java)
}

/// Regex scans of one line that may find no end before the rest of it is read as plain text.
const MAX_FAILED_REGEX_SCANS: u32 = 16;

const JS_REGEX_KEYWORDS: [&str; 14] = [
    "return",
    "typeof",
    "instanceof",
    "in",
    "of",
    "new",
    "delete",
    "void",
    "throw",
    "case",
    "do",
    "else",
    "yield",
    "await",
];

impl<'s> Lexer<'s> {
    fn run(mut self) -> Vec<Token<'s>> {
        while self.i < self.b.len() {
            let c = self.b[self.i];
            let next = self.b.get(self.i + 1).copied();
            match c {
                b'\n' => {
                    self.i += 1;
                    self.line += 1;
                    self.line_start = self.i;
                    self.first_on_line = true;
                    self.failed_regex_scans = 0;
                }
                b' ' | b'\t' | b'\r' | 0x0c => self.i += 1,
                b'#' if self.lang == Lang::Python => self.skip_line(),
                b'/' if self.lang != Lang::Python && next == Some(b'/') => self.skip_line(),
                b'/' if self.lang != Lang::Python && next == Some(b'*') => {
                    self.skip_block_comment();
                }
                b'"' => self.string_at(self.i, self.i),
                b'\'' => self.single_quote(self.i, self.i),
                b'`' if self.lang == Lang::Go => {
                    let end = self.find_byte(self.i + 1, b'`');
                    // Without its closing backtick (the file ends inside it) the rest is the value.
                    let inner_end = if self.b.get(end - 1) == Some(&b'`') && end - 1 > self.i {
                        end - 1
                    } else {
                        end
                    };
                    let value = self.src.get(self.i + 1..inner_end).unwrap_or("").into();
                    self.emit(Tok::Str(value), self.i, end);
                }
                b'`' if self.lang == Lang::Js => {
                    let end = self.template_end(self.i + 1);
                    let inner_end = if self.b.get(end - 1) == Some(&b'`') && end - 1 > self.i {
                        end - 1
                    } else {
                        end
                    };
                    let value = self.src[self.i + 1..inner_end].into();
                    self.emit(Tok::Str(value), self.i, end);
                }
                b'/' if self.lang == Lang::Js
                    && self.i >= self.no_regex_before
                    && self.regex_allowed() =>
                {
                    match self.regex_end(self.i + 1) {
                        Ok(end) => self.emit(Tok::Regex, self.i, end),
                        Err(stopped) => {
                            // A few more tries keep a real regex after an odd `/[` (a scan
                            // from the later `/` starts outside any class); past them, the rest
                            // of the line is read once.
                            self.failed_regex_scans += 1;
                            if self.failed_regex_scans >= MAX_FAILED_REGEX_SCANS {
                                self.no_regex_before = stopped;
                            }
                            self.emit(Tok::Punct(b'/'), self.i, self.i + 1);
                        }
                    }
                }
                c if c.is_ascii_digit() => {
                    let mut j = self.i + 1;
                    while j < self.b.len()
                        && (self.b[j].is_ascii_alphanumeric()
                            || self.b[j] == b'_'
                            || self.b[j] == b'.')
                    {
                        j += 1;
                    }
                    self.emit(Tok::Number, self.i, j);
                }
                c if is_ident_start(c, self.lang) => self.ident(),
                c => {
                    // Keep whole UTF-8 sequences together (non-ASCII bytes are identifiers above).
                    self.emit(Tok::Punct(c), self.i, self.i + 1);
                }
            }
        }
        self.out
    }

    /// Records a token spanning `start..end` and moves past it, counting newlines inside it.
    fn emit(&mut self, kind: Tok, start: usize, end: usize) {
        let end = end.min(self.b.len()).max(start + 1).min(self.b.len());
        let indent = if self.first_on_line {
            Some(visual_column(&self.b[self.line_start..start]))
        } else {
            None
        };
        self.first_on_line = false;
        self.out.push(Token {
            kind,
            text: &self.src[start..end],
            start,
            line: self.line,
            indent,
        });
        self.advance_to(start, end);
    }

    /// Moves to `end`, counting the newlines between `from` and `end`.
    fn advance_to(&mut self, from: usize, end: usize) {
        for (k, &c) in self.b[from..end].iter().enumerate() {
            if c == b'\n' {
                self.line += 1;
                self.line_start = from + k + 1;
            }
        }
        self.i = end;
    }

    fn skip_line(&mut self) {
        while self.i < self.b.len() && self.b[self.i] != b'\n' {
            self.i += 1;
        }
    }

    fn skip_block_comment(&mut self) {
        let start = self.i;
        let nested = self.lang == Lang::Rust;
        let mut depth = 0usize;
        let mut j = self.i;
        while j < self.b.len() {
            if self.b[j] == b'/' && self.b.get(j + 1) == Some(&b'*') {
                if depth == 0 || nested {
                    depth += 1;
                }
                j += 2;
            } else if self.b[j] == b'*' && self.b.get(j + 1) == Some(&b'/') {
                depth -= 1;
                j += 2;
                if depth == 0 {
                    break;
                }
            } else {
                j += 1;
            }
        }
        // A comment was no token: newlines inside count, but the line's first token is still
        // to come if the comment started the line.
        let first = self.first_on_line;
        self.advance_to(start, j.min(self.b.len()));
        if self.line_start > start {
            self.first_on_line = true;
        } else {
            self.first_on_line = first;
        }
    }

    fn find_byte(&self, from: usize, c: u8) -> usize {
        self.b[from.min(self.b.len())..]
            .iter()
            .position(|&x| x == c)
            .map_or(self.b.len(), |p| from + p + 1)
    }

    /// A `"` string (or a prefixed one whose prefix starts at `token_start`).
    fn string_at(&mut self, token_start: usize, quote_at: usize) {
        let triple = self.b[quote_at..].starts_with(b"\"\"\"");
        match self.lang {
            Lang::Python | Lang::Java if triple => self.triple_string(token_start, quote_at, b'"'),
            Lang::Rust => self.quoted(token_start, quote_at, b'"', true, Tok::Str(String::new())),
            _ => self.quoted(token_start, quote_at, b'"', false, Tok::Str(String::new())),
        }
    }

    /// A `'`: a string (Python, JavaScript), a char literal (Go, Java, Rust) or a Rust lifetime.
    fn single_quote(&mut self, token_start: usize, quote_at: usize) {
        match self.lang {
            Lang::Python if self.b[quote_at..].starts_with(b"'''") => {
                self.triple_string(token_start, quote_at, b'\'');
            }
            Lang::Python | Lang::Js => {
                self.quoted(token_start, quote_at, b'\'', false, Tok::Str(String::new()));
            }
            Lang::Go | Lang::Java => self.quoted(token_start, quote_at, b'\'', false, Tok::Char),
            Lang::Rust => {
                let after = quote_at + 1;
                let is_char = match self.b.get(after) {
                    Some(b'\\') => true,
                    Some(_) => {
                        let ch_len = self.src[after..].chars().next().map_or(1, char::len_utf8);
                        self.b.get(after + ch_len) == Some(&b'\'')
                    }
                    None => false,
                };
                if is_char {
                    self.quoted(token_start, quote_at, b'\'', false, Tok::Char);
                } else {
                    self.emit(Tok::Punct(b'\''), quote_at, quote_at + 1);
                }
            }
        }
    }

    /// Scans a quoted literal with backslash escapes, from the quote at `quote_at`.
    fn quoted(
        &mut self,
        token_start: usize,
        quote_at: usize,
        quote: u8,
        multiline: bool,
        kind: Tok,
    ) {
        let mut j = quote_at + 1;
        let mut closed = false;
        while j < self.b.len() {
            match self.b[j] {
                // A backslash before a CRLF continues the line over both bytes.
                b'\\' if self.b[j + 1..].starts_with(b"\r\n") => j += 3,
                b'\\' => j += 2,
                c if c == quote => {
                    closed = true;
                    j += 1;
                    break;
                }
                b'\n' if !multiline => break,
                _ => j += 1,
            }
        }
        let j = j.min(self.b.len());
        let inner_end = if closed { j - 1 } else { j };
        let kind = match kind {
            Tok::Str(_) => Tok::Str(unescape(
                &self.src[quote_at + 1..inner_end.max(quote_at + 1)],
            )),
            other => other,
        };
        self.emit(kind, token_start, j);
    }

    fn triple_string(&mut self, token_start: usize, quote_at: usize, quote: u8) {
        let delim = [quote; 3];
        let mut j = quote_at + 3;
        let mut end = self.b.len();
        let mut inner_end = self.b.len();
        while j < self.b.len() {
            if self.b[j] == b'\\' {
                j += 2;
            } else if self.b[j..].starts_with(&delim) {
                inner_end = j;
                end = j + 3;
                break;
            } else {
                j += 1;
            }
        }
        let value =
            unescape(&self.src[quote_at + 3..inner_end.max(quote_at + 3).min(self.b.len())]);
        self.emit(Tok::Str(value), token_start, end);
    }

    fn ident(&mut self) {
        let start = self.i;
        let mut j = start + 1;
        while j < self.b.len() && is_ident_continue(self.b[j], self.lang) {
            j += 1;
        }
        let word = &self.src[start..j];
        let next = self.b.get(j).copied();
        match self.lang {
            Lang::Python if is_python_prefix(word) && matches!(next, Some(b'"' | b'\'')) => {
                if next == Some(b'"') {
                    self.string_at(start, j);
                } else {
                    self.single_quote(start, j);
                }
            }
            Lang::Rust => self.rust_ident(start, j, word, next),
            _ => self.emit(Tok::Ident, start, j),
        }
    }

    fn rust_ident(&mut self, start: usize, j: usize, word: &str, next: Option<u8>) {
        let raw_capable = matches!(word, "r" | "br" | "cr");
        match next {
            Some(b'"') if matches!(word, "r" | "br" | "cr") => self.rust_raw_string(start, j),
            Some(b'"') if matches!(word, "b" | "c") => self.string_at(start, j),
            Some(b'\'') if word == "b" => self.quoted(start, j, b'\'', false, Tok::Char),
            Some(b'#') if raw_capable => {
                let mut k = j;
                while self.b.get(k) == Some(&b'#') {
                    k += 1;
                }
                if self.b.get(k) == Some(&b'"') {
                    self.rust_raw_string(start, j);
                } else if word == "r"
                    && k == j + 1
                    && self
                        .b
                        .get(k)
                        .is_some_and(|&c| is_ident_start(c, Lang::Rust))
                {
                    // Raw identifier `r#name`.
                    let mut e = k + 1;
                    while e < self.b.len() && is_ident_continue(self.b[e], Lang::Rust) {
                        e += 1;
                    }
                    self.emit(Tok::Ident, start, e);
                } else {
                    self.emit(Tok::Ident, start, j);
                }
            }
            _ => self.emit(Tok::Ident, start, j),
        }
    }

    /// `r#*"…"#*` starting with the hashes (or quote) at `j`.
    fn rust_raw_string(&mut self, start: usize, j: usize) {
        let mut k = j;
        let mut hashes = 0;
        while self.b.get(k) == Some(&b'#') {
            hashes += 1;
            k += 1;
        }
        let content_start = k + 1;
        let mut m = content_start;
        let mut end = self.b.len();
        let mut inner_end = self.b.len();
        while m < self.b.len() {
            // Counted up to the first byte that is not `#`: a closing run is read once, from
            // the quote before it, however many hashes the opening had (counting all `hashes`
            // bytes after every quote was quadratic in a line of quotes).
            if self.b[m] == b'"'
                && self.b[m + 1..]
                    .iter()
                    .take(hashes)
                    .take_while(|&&c| c == b'#')
                    .count()
                    == hashes
            {
                inner_end = m;
                end = m + 1 + hashes;
                break;
            }
            m += 1;
        }
        let value = self.src[content_start.min(inner_end)..inner_end].to_string();
        self.emit(Tok::Str(value), start, end);
    }

    /// The end (exclusive) of a template literal whose content starts at `from`. Templates and
    /// their `${…}` expressions nest (`` `a${`b${c}`}` ``); the open ones are kept on a stack of
    /// their own rather than the call stack, which a file of `` `${ `` repeated would overflow.
    fn template_end(&self, from: usize) -> usize {
        /// What is open: a template, or an expression with its count of open braces.
        enum Open {
            Template,
            Expression(usize),
        }
        let mut open = vec![Open::Template];
        let mut j = from;
        while let (Some(&c), Some(top)) = (self.b.get(j), open.last_mut()) {
            match top {
                Open::Template => match c {
                    b'\\' => j += 2,
                    b'`' => {
                        j += 1;
                        open.pop();
                        if open.is_empty() {
                            return j;
                        }
                    }
                    b'$' if self.b.get(j + 1) == Some(&b'{') => {
                        j += 2;
                        open.push(Open::Expression(1));
                    }
                    _ => j += 1,
                },
                Open::Expression(braces) => match c {
                    b'{' => {
                        *braces += 1;
                        j += 1;
                    }
                    b'}' => {
                        *braces -= 1;
                        j += 1;
                        if *braces == 0 {
                            open.pop();
                        }
                    }
                    b'`' => {
                        j += 1;
                        open.push(Open::Template);
                    }
                    q @ (b'\'' | b'"') => {
                        j += 1;
                        while j < self.b.len() && self.b[j] != q && self.b[j] != b'\n' {
                            if self.b[j] == b'\\' {
                                j += 1;
                            }
                            j += 1;
                        }
                        j += 1;
                    }
                    b'/' if self.b.get(j + 1) == Some(&b'/') => {
                        while j < self.b.len() && self.b[j] != b'\n' {
                            j += 1;
                        }
                    }
                    b'/' if self.b.get(j + 1) == Some(&b'*') => {
                        j += 2;
                        while j < self.b.len() && !self.b[j..].starts_with(b"*/") {
                            j += 1;
                        }
                        j += 2;
                    }
                    _ => j += 1,
                },
            }
        }
        self.b.len()
    }

    fn regex_allowed(&self) -> bool {
        match self.out.last() {
            None => true,
            Some(t) => match &t.kind {
                Tok::Punct(c) => !matches!(c, b')' | b']'),
                Tok::Ident => JS_REGEX_KEYWORDS.contains(&t.text),
                _ => false,
            },
        }
    }

    /// The end of a regex literal whose body starts at `from`, or `Err` with where the scan
    /// stopped if the line ends first (then the `/` was a division after all).
    fn regex_end(&self, from: usize) -> Result<usize, usize> {
        let mut j = from;
        let mut in_class = false;
        while j < self.b.len() {
            match self.b[j] {
                b'\\' => j += 2,
                b'\n' => return Err(j),
                b'[' => {
                    in_class = true;
                    j += 1;
                }
                b']' => {
                    in_class = false;
                    j += 1;
                }
                b'/' if !in_class => {
                    j += 1;
                    while j < self.b.len() && self.b[j].is_ascii_alphabetic() {
                        j += 1;
                    }
                    return Ok(j);
                }
                _ => j += 1,
            }
        }
        Err(self.b.len())
    }
}

fn is_python_prefix(word: &str) -> bool {
    word.len() <= 2 && word.bytes().all(|c| b"rRbBuUfF".contains(&c))
}

fn visual_column(prefix: &[u8]) -> u32 {
    let mut col = 0u32;
    for &c in prefix {
        col = if c == b'\t' {
            (col / 8 + 1) * 8
        } else {
            col + 1
        };
    }
    col
}

/// Resolves the common escapes (`\\`, quotes, `\n`, `\t`); others are kept as written.
fn unescape(s: &str) -> String {
    if !s.contains('\\') {
        return s.to_string();
    }
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some(q @ ('\\' | '"' | '\'' | '`')) => out.push(q),
            Some('\n') => {}
            // A line continuation written with CRLF.
            Some('\r') if chars.clone().next() == Some('\n') => {
                chars.next();
            }
            Some(other) => {
                out.push('\\');
                out.push(other);
            }
            None => out.push('\\'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(src: &str, lang: Lang) -> Vec<String> {
        lex(src, lang)
            .iter()
            .map(|t| match &t.kind {
                Tok::Ident => format!("id:{}", t.text),
                Tok::Punct(c) => format!("p:{}", *c as char),
                Tok::Str(v) => format!("s:{v}"),
                Tok::Number => format!("n:{}", t.text),
                Tok::Char => format!("c:{}", t.text),
                Tok::Regex => format!("re:{}", t.text),
            })
            .collect()
    }

    #[test]
    fn a_line_continuation_reads_the_same_with_crlf() {
        for src in ["it('a \\\n b', f);", "it('a \\\r\n b', f);"] {
            let toks = lex(src, Lang::Js);
            let strings: Vec<&str> = toks.iter().filter_map(|t| t.str_value()).collect();
            assert_eq!(strings, ["a  b"], "{src:?}");
        }
    }

    #[test]
    fn rust_comments_strings_and_lifetimes() {
        let src = "/* a /* nested #[test] */ still */ fn a<'x>(s: &'x str) -> char { let _ = \"#[test] fn f\"; let _ = r#\"fn \"g\"\"#; '{' }\n// #[test]\n";
        let toks = kinds(src, Lang::Rust);
        assert_eq!(
            toks,
            [
                "id:fn",
                "id:a",
                "p:<",
                "p:'",
                "id:x",
                "p:>",
                "p:(",
                "id:s",
                "p::",
                "p:&",
                "p:'",
                "id:x",
                "id:str",
                "p:)",
                "p:-",
                "p:>",
                "id:char",
                "p:{",
                "id:let",
                "id:_",
                "p:=",
                "s:#[test] fn f",
                "p:;",
                "id:let",
                "id:_",
                "p:=",
                "s:fn \"g\"",
                "p:;",
                "c:'{'",
                "p:}"
            ]
        );
    }

    #[test]
    fn rust_byte_strings_and_raw_idents() {
        let toks = kinds("b\"x\" br#\"y\"# b'z' r#type c\"w\"", Lang::Rust);
        assert_eq!(toks, ["s:x", "s:y", "c:b'z'", "id:r#type", "s:w"]);
    }

    #[test]
    fn python_prefixes_triple_quotes_and_indent() {
        let src = "def f():\n    '''doc\n    def test_no(): pass\n    '''\n    return rb'x' # def test_c\n";
        let toks = lex(src, Lang::Python);
        let names: Vec<_> = toks.iter().map(|t| t.text).collect();
        assert_eq!(
            names,
            [
                "def",
                "f",
                "(",
                ")",
                ":",
                "'''doc\n    def test_no(): pass\n    '''",
                "return",
                "rb'x'"
            ]
        );
        assert_eq!(toks[5].indent, Some(4));
        assert_eq!(toks[6].line, 5);
        assert_eq!(toks[6].indent, Some(4));
    }

    #[test]
    fn js_templates_regexes_and_comments() {
        let src = "it(`adds ${a + `n${b}`} items`, () => { const r = /it\\('x'\\)[/]/g; x = a / b / c; })\n/* it('no') */";
        let toks = kinds(src, Lang::Js);
        assert_eq!(toks[0], "id:it");
        assert_eq!(toks[2], "s:adds ${a + `n${b}`} items");
        assert!(toks.contains(&"re:/it\\('x'\\)[/]/g".to_string()));
        assert_eq!(toks.iter().filter(|t| t.as_str() == "p:/").count(), 2);
        assert!(!toks.iter().any(|t| t.contains("no")));
    }

    #[test]
    fn unterminated_single_line_string_stops_at_newline() {
        let toks = kinds("<p>Don't</p>\nit('ok')", Lang::Js);
        assert!(toks.contains(&"id:it".to_string()));
        assert!(toks.contains(&"s:ok".to_string()));
    }

    #[test]
    fn go_raw_strings_and_runes() {
        let toks = kinds("t.Run(`raw \"name\"`, f) x := '\\''", Lang::Go);
        assert_eq!(toks[4], "s:raw \"name\"");
        assert_eq!(toks.last().unwrap(), "c:'\\''");
    }

    #[test]
    fn java_text_blocks_and_chars() {
        let toks = kinds(
            "String s = \"\"\"\n  @Test\n  \"\"\"; char c = '\"'; @Test",
            Lang::Java,
        );
        assert_eq!(toks.iter().filter(|t| t.as_str() == "id:Test").count(), 1);
        assert!(toks.contains(&"c:'\"'".to_string()));
    }

    #[test]
    fn lines_are_counted_through_comments_and_strings() {
        let toks = lex("/*\n\n*/ a\n\"x\ny\" b", Lang::Rust);
        assert_eq!(toks[0].line, 3);
        assert_eq!(toks[0].indent, Some(3));
        assert_eq!(toks[2].line, 5);
    }

    #[test]
    fn deeply_nested_templates_do_not_overflow_the_stack() {
        // Each level used to be a call of its own: this overflowed a thread's stack, which
        // aborts the whole process.
        let src = "`${".repeat(300_000);
        assert_eq!(lex(&src, Lang::Js).len(), 1, "one unterminated template");
        assert_eq!(
            kinds("x = `a${`b${{c: 1}}`}d`; y", Lang::Js),
            ["id:x", "p:=", "s:a${`b${{c: 1}}`}d", "p:;", "id:y"]
        );
    }

    #[test]
    fn a_raw_string_with_many_hashes_and_quotes_is_read_in_linear_time() {
        // Every quote inside used to count the opening's 300,000 hashes' worth of bytes after it.
        let src = format!("r{}\"{}", "#".repeat(300_000), "\"".repeat(600_000));
        let started = std::time::Instant::now();
        assert_eq!(
            lex(&src, Lang::Rust).len(),
            1,
            "one unterminated raw string"
        );
        // Milliseconds in a debug build; the quadratic count took minutes.
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(
            kinds(r####"x = r##"a"#b"##; y"####, Lang::Rust),
            ["id:x", "p:=", "s:a\"#b", "p:;", "id:y"]
        );
    }

    #[test]
    fn a_line_of_slashes_that_never_end_a_regex_is_read_a_bounded_number_of_times() {
        // Every `/` here may start a regex, and none ends on the line; each used to be scanned
        // to the end of the line again.
        let src = "[/".repeat(200_000);
        let started = std::time::Instant::now();
        assert_eq!(lex(&src, Lang::Js).len(), 400_000);
        // Milliseconds in a debug build; scanning from every `/` again took about a minute.
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
        // A regex after an odd `/[` on the same line is still one.
        assert!(
            kinds("a = /[ ; b = /x'/", Lang::Js).contains(&"re:/x'/".to_owned()),
            "{:?}",
            kinds("a = /[ ; b = /x'/", Lang::Js)
        );
        // The next line starts afresh.
        let after = format!("{}\nx = /a[/]b/g;", "[/".repeat(300));
        assert!(
            kinds(&after, Lang::Js).contains(&"re:/a[/]b/g".to_owned()),
            "{:?}",
            kinds(&after, Lang::Js)
        );
    }
}
