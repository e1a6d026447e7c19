//! Validated queue names: ASCII letters, digits, `_` and `-`, 1 to 128 characters (SPEC §2).
//!
//! Seed ADR-16 moved from `analysis:priority` to `analysis_priority` because River rejects `:`;
//! Fairlane keeps the same alphabet so names stay portable, and checks it at startup and insert.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The longest queue name accepted.
pub const MAX_QUEUE_NAME_LEN: usize = 128;

/// A queue name that passed validation.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct QueueName(String);

/// Why a string is not a valid queue name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QueueNameError {
    #[error("queue name is empty")]
    Empty,
    #[error("queue name is {len} characters long; the limit is {MAX_QUEUE_NAME_LEN}")]
    TooLong { len: usize },
    #[error(
        "queue name `{name}` contains {found:?} at position {position}; only ASCII letters, digits, `_` and `-` are allowed"
    )]
    InvalidCharacter {
        name: String,
        found: char,
        position: usize,
    },
}

impl QueueName {
    /// Validates `name` and wraps it.
    pub fn new(name: impl Into<String>) -> Result<Self, QueueNameError> {
        let name = name.into();
        validate(&name)?;
        Ok(QueueName(name))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

fn validate(name: &str) -> Result<(), QueueNameError> {
    if name.is_empty() {
        return Err(QueueNameError::Empty);
    }
    let len = name.chars().count();
    if len > MAX_QUEUE_NAME_LEN {
        return Err(QueueNameError::TooLong { len });
    }
    if let Some((position, found)) = name
        .chars()
        .enumerate()
        .find(|(_, c)| !(c.is_ascii_alphanumeric() || *c == '_' || *c == '-'))
    {
        return Err(QueueNameError::InvalidCharacter {
            name: name.to_owned(),
            found,
            position,
        });
    }
    Ok(())
}

impl FromStr for QueueName {
    type Err = QueueNameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        QueueName::new(s)
    }
}

impl TryFrom<String> for QueueName {
    type Error = QueueNameError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        QueueName::new(s)
    }
}

impl From<QueueName> for String {
    fn from(q: QueueName) -> String {
        q.0
    }
}

impl AsRef<str> for QueueName {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for QueueName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_the_allowed_alphabet() {
        for ok in ["a", "analysis_priority", "Queue-1_x", &"q".repeat(128)] {
            assert!(QueueName::new(ok).is_ok(), "{ok} should be valid");
        }
    }

    #[test]
    fn rejects_empty_and_too_long() {
        assert_eq!(QueueName::new(""), Err(QueueNameError::Empty));
        assert_eq!(
            QueueName::new("q".repeat(129)),
            Err(QueueNameError::TooLong { len: 129 })
        );
    }

    #[test]
    fn rejects_colon_space_and_non_ascii() {
        for (bad, ch, pos) in [
            ("analysis:priority", ':', 8),
            ("has space", ' ', 3),
            ("dot.name", '.', 3),
            ("ünicode", 'ü', 0),
        ] {
            match QueueName::new(bad) {
                Err(QueueNameError::InvalidCharacter {
                    found, position, ..
                }) => {
                    assert_eq!((found, position), (ch, pos), "{bad}");
                }
                other => panic!("{bad}: expected InvalidCharacter, got {other:?}"),
            }
        }
    }

    #[test]
    fn error_messages_say_what_is_wrong() {
        let msg = QueueName::new("a:b").unwrap_err().to_string();
        assert!(msg.contains("':'") && msg.contains("position 1"), "{msg}");
    }

    #[test]
    fn serde_validates() {
        assert!(serde_json::from_str::<QueueName>("\"ok_name\"").is_ok());
        assert!(serde_json::from_str::<QueueName>("\"bad:name\"").is_err());
    }
}
