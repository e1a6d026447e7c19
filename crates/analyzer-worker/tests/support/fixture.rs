//! A repository with tests of every supported framework in nested folders, next to files that
//! look like tests but are not, and the exact inventory and specification expected of it.

#![allow(dead_code, unreachable_pub)]

use super::GitFixture;

const RUST_LIB: &str = r##"//! Order parsing. Mark a function with `#[test]` to test it.
pub fn parse(input: &str) -> Vec<&str> {
    input.split(',').collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_empty_input() {
        assert_eq!(parse(""), vec![""]);
    }

    #[test]
    #[ignore]
    fn handles_huge_input() {}

    mod nested {
        #[tokio::test]
        async fn reads_from_socket() {}
    }
}
"##;

const RUST_LOOKALIKE: &str = r##"/// Helpers, not tests: a "#[test]" in a comment is not a test.
pub const EXAMPLE: &str = "#[test] fn fake() {}";
// #[test]
// fn commented_out() {}
pub fn testing_helper() {}
"##;

const RUST_INTEGRATION: &str = r#"use core_lib::parse;

#[test]
fn round_trips_every_value() {}

#[test]
fn test_rejects_garbage() {}
"#;

const GO_TEST: &str = r#"package api

import "testing"

func TestHandlerReturnsOK(t *testing.T) {
	t.Run("with auth", func(t *testing.T) {})
	t.Run("without auth", func(t *testing.T) {})
}

func TestListUsers(t *testing.T) {
	t.Skip("flaky")
}

func BenchmarkHandler(b *testing.B) {}
"#;

const GO_LOOKALIKE: &str = r#"package api

import "testing"

// Not a _test.go file: never run by `go test`.
func TestNotATest(t *testing.T) {}
"#;

const PY_ORDERS: &str = r#"import pytest


def test_order_total():
    assert 1 + 1 == 2


class TestRefunds:
    def test_full_refund(self):
        pass

    @pytest.mark.skip(reason="later")
    def test_partial_refund(self):
        pass

    def helper(self):
        pass
"#;

const PY_MODELS: &str = r#"import unittest


class OrderModelTest(unittest.TestCase):
    def test_saves(self):
        pass

    def test_deletes(self):
        pass
"#;

const PY_LOOKALIKE_READ: &str = r#""""Utilities for tests.

def test_in_docstring():
    pass
"""


def make_order():
    return {}
"#;

const JS_CART: &str = r#"describe('cart', () => {
  it('adds an item', () => {});
  it.todo('applies coupons');
});
"#;

const TS_BUTTON: &str = r#"import { describe, it, expect } from 'vitest';

describe('Button', () => {
  it('renders its label', () => {
    expect(1).toBe(1);
  });
  it.skip('handles clicks', () => {});
});
"#;

const JS_MOCHA: &str = r#"const assert = require('assert');

describe('legacy api', function () {
  context('when offline', function () {
    it('queues requests', function () {
      assert.ok(true);
    });
  });
});
"#;

const JS_LOOKALIKE: &str = r#"export function test(value) {
  return value;
}
test('not a test file');
"#;

const JAVA_JUNIT5: &str = r#"package org.shop;

import org.junit.jupiter.api.DisplayName;
import org.junit.jupiter.api.Nested;
import org.junit.jupiter.api.Test;

class CheckoutTest {
    @Test
    void totalsTheBasket() {}

    @Nested
    class WhenEmpty {
        @Test
        @DisplayName("shows an empty message")
        void emptyMessage() {}
    }
}
"#;

const JAVA_JUNIT4: &str = r#"package org.shop;

import org.junit.Test;

public class LegacyCartTest {
    @Test
    public void addsItems() {}
}
"#;

const JAVA_LOOKALIKE: &str = r#"package org.shop;

/** Put @Test on the methods of CheckoutTest. */
public class Checkout {
    public String hint() {
        return "@Test void x() {}";
    }
}
"#;

/// Writes the fixture's files and commits them; returns the commit.
pub fn build(repo: &GitFixture) -> String {
    repo.write("crates/core/src/lib.rs", RUST_LIB);
    repo.write("crates/core/src/util.rs", RUST_LOOKALIKE);
    repo.write("crates/core/tests/roundtrip.rs", RUST_INTEGRATION);
    repo.write("services/api/handler_test.go", GO_TEST);
    repo.write("services/api/handler.go", GO_LOOKALIKE);
    repo.write(
        "services/api/testdata/golden_test.go",
        "package golden\n\nimport \"testing\"\n\nfunc TestGolden(t *testing.T) {}\n",
    );
    repo.write("backend/tests/test_orders.py", PY_ORDERS);
    repo.write("backend/tests/test_models.py", PY_MODELS);
    repo.write("backend/testing_utils.py", PY_LOOKALIKE_READ);
    repo.write("backend/helpers.py", "def test_helper():\n    pass\n");
    repo.write(
        "frontend/package.json",
        r#"{"devDependencies": {"jest": "^29.0.0"}}"#,
    );
    repo.write("frontend/src/cart.test.js", JS_CART);
    repo.write("frontend/src/cart.js", JS_LOOKALIKE);
    repo.write("frontend/src/components/__tests__/Button.tsx", TS_BUTTON);
    repo.write(
        "frontend/legacy/package.json",
        r#"{"devDependencies": {"mocha": "^10.0.0"}}"#,
    );
    repo.write("frontend/legacy/test/api.spec.js", JS_MOCHA);
    repo.write(
        "frontend/node_modules/left-pad/index.test.js",
        "it('is vendored', () => {});\n",
    );
    repo.write("java/src/test/java/org/shop/CheckoutTest.java", JAVA_JUNIT5);
    repo.write(
        "java/src/test/java/org/shop/LegacyCartTest.java",
        JAVA_JUNIT4,
    );
    repo.write("java/src/main/java/org/shop/Checkout.java", JAVA_LOOKALIKE);
    repo.write(
        "docs/testing.md",
        "Write `def test_*` functions and `#[test]` fns.\n",
    );
    repo.commit("every framework")
}

/// A second commit: one more Go test in a new file.
pub fn add_users_test(repo: &GitFixture) -> String {
    repo.write(
        "services/api/users_test.go",
        "package api\n\nimport \"testing\"\n\nfunc TestCreateUser(t *testing.T) {}\n",
    );
    repo.commit("users test")
}

/// Every test of [`build`]'s commit: `path (framework) | suite > … > name | modifier`.
pub const EXPECTED_TESTS: [&str; 22] = [
    "backend/tests/test_models.py (unittest) | OrderModelTest > test_saves | none",
    "backend/tests/test_models.py (unittest) | OrderModelTest > test_deletes | none",
    "backend/tests/test_orders.py (pytest) | test_order_total | none",
    "backend/tests/test_orders.py (pytest) | TestRefunds > test_full_refund | none",
    "backend/tests/test_orders.py (pytest) | TestRefunds > test_partial_refund | skip",
    "crates/core/src/lib.rs (rust) | tests > parses_empty_input | none",
    "crates/core/src/lib.rs (rust) | tests > handles_huge_input | skip",
    "crates/core/src/lib.rs (rust) | tests > nested > reads_from_socket | none",
    "crates/core/tests/roundtrip.rs (rust) | round_trips_every_value | none",
    "crates/core/tests/roundtrip.rs (rust) | test_rejects_garbage | none",
    "frontend/legacy/test/api.spec.js (mocha) | legacy api > when offline > queues requests | none",
    "frontend/src/cart.test.js (jest) | cart > adds an item | none",
    "frontend/src/cart.test.js (jest) | cart > applies coupons | todo",
    "frontend/src/components/__tests__/Button.tsx (vitest) | Button > renders its label | none",
    "frontend/src/components/__tests__/Button.tsx (vitest) | Button > handles clicks | skip",
    "java/src/test/java/org/shop/CheckoutTest.java (junit5) | CheckoutTest > totalsTheBasket | none",
    "java/src/test/java/org/shop/CheckoutTest.java (junit5) | CheckoutTest > WhenEmpty > emptyMessage | none",
    "java/src/test/java/org/shop/LegacyCartTest.java (junit4) | LegacyCartTest > addsItems | none",
    "services/api/handler_test.go (go) | TestHandlerReturnsOK | none",
    "services/api/handler_test.go (go) | TestHandlerReturnsOK > with auth | none",
    "services/api/handler_test.go (go) | TestHandlerReturnsOK > without auth | none",
    "services/api/handler_test.go (go) | TestListUsers | skip",
];

/// Tests per framework of [`build`]'s commit, in the inventory's (framework) order.
pub const EXPECTED_PER_FRAMEWORK: [(&str, u64); 9] = [
    ("rust", 5),
    ("go", 4),
    ("pytest", 3),
    ("unittest", 2),
    ("jest", 2),
    ("vitest", 2),
    ("mocha", 1),
    ("junit4", 1),
    ("junit5", 2),
];

/// The specification of [`build`]'s commit, as `GET /v1/specviews/{id}` serves it in Markdown.
pub const EXPECTED_MARKDOWN: &str = "# Behaviour specification

22 behaviours in 10 files (4 skipped, 1 to do).

## `backend/tests/test_models.py` (unittest)

- **order model**
  - saves
  - deletes

## `backend/tests/test_orders.py` (pytest)

- order total
- **refunds**
  - full refund
  - partial refund _(skipped)_

## `crates/core/src/lib.rs` (rust)

- **tests**
  - parses empty input
  - handles huge input _(skipped)_
  - **nested**
    - reads from socket

## `crates/core/tests/roundtrip.rs` (rust)

- round trips every value
- rejects garbage

## `frontend/legacy/test/api.spec.js` (mocha)

- **legacy api**
  - **when offline**
    - queues requests

## `frontend/src/cart.test.js` (jest)

- **cart**
  - adds an item
  - applies coupons _(to do)_

## `frontend/src/components/__tests__/Button.tsx` (vitest)

- **Button**
  - renders its label
  - handles clicks _(skipped)_

## `java/src/test/java/org/shop/CheckoutTest.java` (junit5)

- **checkout**
  - totals the basket
  - **when empty**
    - shows an empty message

## `java/src/test/java/org/shop/LegacyCartTest.java` (junit4)

- **legacy cart**
  - adds items

## `services/api/handler_test.go` (go)

- handler returns OK
  - with auth
  - without auth
- list users _(skipped)_
";

/// One line per test of an `inventory::Analysis` as JSON (the API's `result`), in the format of
/// [`EXPECTED_TESTS`].
pub fn describe(result: &serde_json::Value) -> Vec<String> {
    let mut lines = Vec::new();
    for file in result["inventory"]["files"].as_array().expect("files") {
        for test in file["tests"].as_array().expect("tests") {
            let mut path: Vec<String> = test["suite"]
                .as_array()
                .expect("suite")
                .iter()
                .map(|s| s.as_str().expect("suite name").to_owned())
                .collect();
            path.push(test["name"].as_str().expect("name").to_owned());
            lines.push(format!(
                "{} ({}) | {} | {}",
                file["path"].as_str().expect("path"),
                file["framework"].as_str().expect("framework"),
                path.join(" > "),
                test["modifier"].as_str().expect("modifier"),
            ));
        }
    }
    lines
}
