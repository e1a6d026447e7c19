//! How a binary reports why it could not start or run: the error and its causes on one line, for
//! `main` to print on stderr before it exits with a non-zero code; a command line clap refuses,
//! the same way; and the text of a caught panic.

use std::error::Error;
use std::process::ExitCode;

/// The command line as `C`, or the exit `main` must take. `--help` and `--version` print and exit
/// 0 as clap does; anything else clap refuses (a bad value, a missing argument or subcommand) is
/// one line on stderr, `program: …`, and exit code 1, like every other failure to start.
pub fn parse_command_line<C: clap::Parser>(program: &str) -> Result<C, ExitCode> {
    match C::try_parse() {
        Ok(cli) => Ok(cli),
        Err(e) if !e.use_stderr() => e.exit(),
        Err(e) => Err(refused(
            program,
            &command_line_error(
                e.kind() == clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand,
                &e.to_string(),
            ),
        )),
    }
}

/// How `main` ends with `result`: success, or the error and its causes as one line on stderr
/// (`program: …`, [`one_line`]) and exit code 1.
pub fn exit_code<E: AsRef<dyn Error + 'static>>(program: &str, result: Result<(), E>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => refused(program, &one_line(e.as_ref())),
    }
}

/// Prints `program: line` on stderr; exit code 1.
fn refused(program: &str, line: &str) -> ExitCode {
    #[allow(clippy::print_stderr)]
    {
        eprintln!("{program}: {line}");
    }
    ExitCode::FAILURE
}

/// clap's rendering of a refused command line as one line: the message up to its first blank
/// line (the usage and the `--help` hint that follow are left out), without its `error:` prefix.
/// A missing subcommand renders as the whole help, so it gets a line of its own.
fn command_line_error(missing_subcommand: bool, rendered: &str) -> String {
    if missing_subcommand {
        return "a subcommand is required (see --help)".to_owned();
    }
    let message: Vec<&str> = rendered
        .lines()
        .take_while(|line| !line.trim().is_empty())
        .map(str::trim)
        .collect();
    let line = message.join(" ");
    line.strip_prefix("error: ").unwrap_or(&line).to_owned()
}

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
    fn a_refused_command_line_is_one_line_without_usage() {
        assert_eq!(
            command_line_error(
                false,
                "error: invalid value '42' for '--user <USER>': invalid length\n\n\
                 For more information, try '--help'.\n"
            ),
            "invalid value '42' for '--user <USER>': invalid length"
        );
        assert_eq!(
            command_line_error(
                false,
                "error: the following required arguments were not provided:\n  --tier <TIER>\n\n\
                 Usage: web admin set-tier --user <USER> --tier <TIER>\n\n\
                 For more information, try '--help'.\n"
            ),
            "the following required arguments were not provided: --tier <TIER>"
        );
        assert_eq!(
            command_line_error(true, "Fairlane's HTTP API\n\nUsage: web <COMMAND>\n"),
            "a subcommand is required (see --help)"
        );
    }

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
