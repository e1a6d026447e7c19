//! Finds the line and column of a YAML path (`descriptors[1].rate_limit.unit`) in a document.
//!
//! serde_yaml attaches the position of the node being deserialized to an error raised while it
//! is being deserialized. To find where a path is, we walk the document along the path and raise
//! an error at its end; the error's location is the answer. Only used to report mistakes.

use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// One step of a YAML path: a mapping key or a sequence index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Segment {
    Key(&'static str),
    Index(usize),
}

/// A YAML path, displayed the way serde_yaml displays paths in its own errors.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct YamlPath(pub(crate) Vec<Segment>);

impl YamlPath {
    /// This path extended by `segment`.
    pub(crate) fn child(&self, segment: Segment) -> YamlPath {
        let mut segments = self.0.clone();
        segments.push(segment);
        YamlPath(segments)
    }

    /// This path extended by mapping key `key`.
    pub(crate) fn key(&self, key: &'static str) -> YamlPath {
        self.child(Segment::Key(key))
    }
}

impl fmt::Display for YamlPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str(".");
        }
        for (i, segment) in self.0.iter().enumerate() {
            match segment {
                Segment::Key(k) if i == 0 => write!(f, "{k}")?,
                Segment::Key(k) => write!(f, ".{k}")?,
                Segment::Index(n) => write!(f, "[{n}]")?,
            }
        }
        Ok(())
    }
}

/// One-based line and column of the node at `path` in `text`, if it exists.
pub(crate) fn locate(text: &str, path: &YamlPath) -> Option<(usize, usize)> {
    let deserializer = serde_yaml::Deserializer::from_str(text);
    match (Locator { rest: &path.0 }).deserialize(deserializer) {
        Err(err) => err.location().map(|loc| (loc.line(), loc.column())),
        Ok(()) => None,
    }
}

struct Locator<'p> {
    rest: &'p [Segment],
}

impl<'de> DeserializeSeed<'de> for Locator<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        match self.rest.split_first() {
            None => deserializer.deserialize_any(Here),
            Some((Segment::Key(key), rest)) => deserializer.deserialize_map(MapStep { key, rest }),
            Some((Segment::Index(index), rest)) => deserializer.deserialize_seq(SeqStep {
                index: *index,
                rest,
            }),
        }
    }
}

/// Refuses whatever it is given, so that the error carries this node's position.
struct Here;

impl<'de> Visitor<'de> for Here {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("nothing (locating a node)")
    }
}

struct MapStep<'p> {
    key: &'static str,
    rest: &'p [Segment],
}

impl<'de> Visitor<'de> for MapStep<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a mapping with key `{}`", self.key)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<String>()? {
            if key == self.key {
                return map.next_value_seed(Locator { rest: self.rest });
            }
            map.next_value::<IgnoredAny>()?;
        }
        Ok(())
    }
}

struct SeqStep<'p> {
    index: usize,
    rest: &'p [Segment],
}

impl<'de> Visitor<'de> for SeqStep<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a sequence with an element {}", self.index)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut i = 0;
        while i < self.index {
            if seq.next_element::<IgnoredAny>()?.is_none() {
                return Ok(());
            }
            i += 1;
        }
        seq.next_element_seed(Locator { rest: self.rest })?;
        // Drain the rest so the sequence is well formed.
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n  - key: b\n    descriptors:\n      - key: c\n        value: x\n";

    #[test]
    fn finds_nested_nodes() {
        let p = YamlPath(vec![
            Segment::Key("descriptors"),
            Segment::Index(0),
            Segment::Key("rate_limit"),
            Segment::Key("unit"),
        ]);
        assert_eq!(p.to_string(), "descriptors[0].rate_limit.unit");
        assert_eq!(locate(DOC, &p), Some((5, 13)));
        let p = YamlPath(vec![
            Segment::Key("descriptors"),
            Segment::Index(1),
            Segment::Key("descriptors"),
            Segment::Index(0),
            Segment::Key("value"),
        ]);
        assert_eq!(locate(DOC, &p), Some((9, 16)));
        let p = YamlPath(vec![Segment::Key("descriptors"), Segment::Index(1)]);
        assert_eq!(locate(DOC, &p), Some((6, 5)));
    }

    #[test]
    fn missing_path_has_no_location() {
        let p = YamlPath(vec![Segment::Key("descriptors"), Segment::Index(7)]);
        assert_eq!(locate(DOC, &p), None);
    }
}
