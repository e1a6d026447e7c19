//! How a binary reports why it could not start or run: the error and its causes on one line, for
//! `main` to print on stderr before it exits with a non-zero code; and the text of a caught panic.

use std::error::Error;

/// `error` and its sources as one line, `outer: inner: innermost`, each cause once: many errors
/// quote their source in their own message and also return it from `source()`, so a cause whose
/// text the line already holds is left out. Line breaks inside a message become spaces.
pub fn one_line(error: &(dyn Error + 'static)) -> String {
    let mut line = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        source = cause.source();
    }
    line.lines()
        .map(str::trim)
        .filter(|part| !part.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// The text a panic carried (`panic!("…")`'s message, formatted or not), `None` for any other
/// payload: what a task or batch that caught a panic logs or records.
pub fn panic_text(payload: &(dyn std::any::Any + Send)) -> Option<&str> {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panics_text_is_read_from_either_payload() {
        let literal = std::panic::catch_unwind(|| panic!("plain")).unwrap_err();
        assert_eq!(panic_text(&*literal), Some("plain"));
        let formatted = std::panic::catch_unwind(|| panic!("job {}", 7)).unwrap_err();
        assert_eq!(panic_text(&*formatted), Some("job 7"));
        let other = std::panic::catch_unwind(|| std::panic::panic_any(7_u8)).unwrap_err();
        assert_eq!(panic_text(&*other), None);
    }

    #[derive(Debug, thiserror::Error)]
    #[error("could not listen on {addr}: {source}")]
    struct Quoting {
        addr: String,
        #[source]
        source: std::io::Error,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("starting")]
    struct Context(#[source] Quoting);

    #[test]
    fn each_cause_appears_once_on_one_line() {
        let e = Context(Quoting {
            addr: "0.0.0.0:9091".into(),
            source: std::io::Error::other("address in use\n(try another port)"),
        });
        assert_eq!(
            one_line(&e),
            "starting: could not listen on 0.0.0.0:9091: address in use (try another port)"
        );
    }
}
