//! Test support: every test gets its own PostgreSQL database, cloned from a template that holds the
//! current migrations (cloning takes milliseconds; migrating each database would take seconds).
//!
//! Connection settings come from `DATABASE_URL` (a server URL; the database part is replaced) or
//! default to `postgres://postgres@127.0.0.1:5432/postgres`. `cargo xtask test` sets them.

pub mod bench;
pub mod git_fixture;
pub mod plan;
pub mod poll;
pub mod process;
pub mod proxy;

pub use poll::eventually;

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, ConnectOptions, Connection, PgConnection, PgPool};

const DEFAULT_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// The server URL tests use (any database part is ignored).
pub fn database_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_URL.to_owned())
}

/// The Redis URL tests use.
pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

fn server_options() -> PgConnectOptions {
    database_url()
        .parse::<PgConnectOptions>()
        .unwrap_or_else(|e| panic!("DATABASE_URL is not a PostgreSQL URL: {e}"))
        .disable_statement_logging()
}

/// A database that exists for one test.
#[derive(Debug)]
pub struct TestDb {
    pub name: String,
    pub pool: PgPool,
    options: PgConnectOptions,
}

impl TestDb {
    /// Creates a fresh, fully migrated database.
    pub async fn new() -> TestDb {
        let template = ensure_template().await;
        // A version 7 id: its first 48 bits are the creation time, by which `cargo xtask test`
        // tells a finished run's database from one just created (README.md, testing).
        let name = format!("fairlane_test_{}", uuid::Uuid::now_v7().simple());
        let mut admin = admin_connection().await;
        // CREATE DATABASE … TEMPLATE needs the template to have no other sessions; templates are
        // only ever connected to while being built, under the same lock.
        with_template_lock(&mut admin, |conn| {
            let name = name.clone();
            let template = template.clone();
            Box::pin(async move {
                sqlx::query(AssertSqlSafe(format!(
                    "CREATE DATABASE {name} TEMPLATE {template}"
                )))
                .execute(conn)
                .await
                .map(|_| ())
            })
        })
        .await
        .unwrap_or_else(|e| panic!("creating test database {name}: {e}"));
        let options = server_options().database(&name);
        let pool = PgPoolOptions::new()
            .max_connections(20)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(options.clone())
            .await
            .unwrap_or_else(|e| panic!("connecting to {name}: {e}"));
        TestDb {
            name,
            pool,
            options,
        }
    }

    /// A URL for this database, for child processes.
    pub fn url(&self) -> String {
        let mut url = self.options.to_url_lossy();
        url.set_path(&format!("/{}", self.name));
        url.to_string()
    }

    /// The server's `host:port`, for a proxy in front of it.
    pub fn server_address(&self) -> String {
        format!("{}:{}", self.options.get_host(), self.options.get_port())
    }

    /// [`TestDb::url`] through `proxy` (a [`proxy::TcpProxy`]'s address) instead of the server.
    pub fn url_through(&self, proxy: std::net::SocketAddr) -> String {
        let mut url = self
            .options
            .clone()
            .host(&proxy.ip().to_string())
            .port(proxy.port())
            .to_url_lossy();
        url.set_path(&format!("/{}", self.name));
        url.to_string()
    }

    /// Makes `level` the default isolation of this database's new sessions (as an operator's
    /// `ALTER DATABASE … SET default_transaction_isolation` would).
    pub async fn set_default_isolation(&self, level: &str) {
        sqlx::query(AssertSqlSafe(format!(
            "ALTER DATABASE \"{}\" SET default_transaction_isolation = '{level}'",
            self.name
        )))
        .execute(&self.pool)
        .await
        .unwrap_or_else(|e| panic!("setting {}'s default isolation: {e}", self.name));
    }

    /// A new pool on this database (e.g. with a different size).
    pub async fn pool_with(&self, max_connections: u32) -> PgPool {
        PgPoolOptions::new()
            .max_connections(max_connections)
            .connect_with(self.options.clone())
            .await
            .unwrap_or_else(|e| panic!("connecting to {}: {e}", self.name))
    }

    /// The number of rows in each table of the schema, for tests that claim nothing was written.
    pub async fn row_counts(&self) -> std::collections::BTreeMap<String, i64> {
        let tables: Vec<(String,)> = sqlx::query_as(
            "SELECT table_name::text FROM information_schema.tables \
             WHERE table_schema = 'public' AND table_type = 'BASE TABLE' ORDER BY 1",
        )
        .fetch_all(&self.pool)
        .await
        .unwrap_or_else(|e| panic!("listing tables: {e}"));
        let mut counts = std::collections::BTreeMap::new();
        for (table,) in tables {
            let (n,): (i64,) =
                sqlx::query_as(AssertSqlSafe(format!("SELECT count(*) FROM \"{table}\"")))
                    .fetch_one(&self.pool)
                    .await
                    .unwrap_or_else(|e| panic!("counting {table}: {e}"));
            counts.insert(table, n);
        }
        counts
    }

    /// [`process::refused_start`] with `DATABASE_URL` set to this database, `HTTP_ADDR` to a free
    /// loopback port and `RUST_LOG` to `warn` (before `envs`, which may override them). Checks
    /// that every table holds the rows it held before; returns the stderr line.
    pub async fn refused_start(
        &self,
        program: &str,
        args: &[&str],
        envs: &[(&str, &str)],
    ) -> String {
        let before = self.row_counts().await;
        let mut all: Vec<(String, String)> = vec![
            ("DATABASE_URL".to_owned(), self.url()),
            ("HTTP_ADDR".to_owned(), "127.0.0.1:0".to_owned()),
            ("RUST_LOG".to_owned(), "warn".to_owned()),
        ];
        all.extend(envs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
        let program = program.to_owned();
        let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        let line = tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let envs: Vec<(&str, &str)> =
                all.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            process::refused_start(&program, &args, &envs)
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            self.row_counts().await,
            before,
            "{envs:?}: rows were written before the refusal"
        );
        line
    }

    /// Terminates every other session on this database (simulates lost connections).
    pub async fn terminate_connections(&self) -> u64 {
        let mut admin = admin_connection().await;
        sqlx::query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = $1 AND pid <> pg_backend_pid()",
        )
        .bind(&self.name)
        .execute(&mut admin)
        .await
        .map(|r| r.rows_affected())
        .unwrap_or_else(|e| panic!("terminating sessions: {e}"))
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        // Databases are dropped by `cargo xtask test` at the start of the next run (and can be
        // dropped by hand: they all start with `fairlane_test_`), so a failing test leaves its
        // data behind for inspection.
    }
}

async fn admin_connection() -> PgConnection {
    let options = server_options();
    let mut delay = Duration::from_millis(50);
    for _ in 0..8 {
        match PgConnection::connect_with(&options).await {
            Ok(c) => return c,
            Err(_) => {
                tokio::time::sleep(delay).await;
                delay *= 2;
            }
        }
    }
    PgConnection::connect_with(&options)
        .await
        .unwrap_or_else(|e| panic!("connecting to PostgreSQL at {}: {e}", database_url()))
}

/// The template's name carries a hash of the migrations, so a changed schema gets a new template.
fn template_name() -> String {
    let mut hasher = DefaultHasher::new();
    for m in schema::MIGRATOR.iter() {
        m.version.hash(&mut hasher);
        m.checksum.hash(&mut hasher);
    }
    format!("fairlane_template_{:016x}", hasher.finish())
}

const TEMPLATE_LOCK: i64 = 0x00fa_1e7a_7e57;

type LockedOp<'c> = std::pin::Pin<Box<dyn Future<Output = Result<(), sqlx::Error>> + Send + 'c>>;

async fn with_template_lock<F>(admin: &mut PgConnection, op: F) -> Result<(), sqlx::Error>
where
    F: for<'c> FnOnce(&'c mut PgConnection) -> LockedOp<'c>,
{
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(TEMPLATE_LOCK)
        .execute(&mut *admin)
        .await?;
    let result = op(admin).await;
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(TEMPLATE_LOCK)
        .execute(&mut *admin)
        .await?;
    result
}

async fn ensure_template() -> String {
    let name = template_name();
    let mut admin = admin_connection().await;
    let exists: Option<(bool,)> =
        sqlx::query_as("SELECT datistemplate FROM pg_database WHERE datname = $1")
            .bind(&name)
            .fetch_optional(&mut admin)
            .await
            .unwrap_or_else(|e| panic!("looking up template: {e}"));
    if exists == Some((true,)) {
        return name;
    }
    let build_name = name.clone();
    with_template_lock(&mut admin, move |conn| {
        Box::pin(async move {
            let state: Option<(bool,)> =
                sqlx::query_as("SELECT datistemplate FROM pg_database WHERE datname = $1")
                    .bind(&build_name)
                    .fetch_optional(&mut *conn)
                    .await?;
            match state {
                Some((true,)) => return Ok(()),
                // A half-built template from a crashed run.
                Some((false,)) => {
                    sqlx::query(AssertSqlSafe(format!(
                        "DROP DATABASE {build_name} WITH (FORCE)"
                    )))
                    .execute(&mut *conn)
                    .await?;
                }
                None => {}
            }
            sqlx::query(AssertSqlSafe(format!("CREATE DATABASE {build_name}")))
                .execute(&mut *conn)
                .await?;
            let pool = PgPoolOptions::new()
                .max_connections(1)
                .connect_with(server_options().database(&build_name))
                .await?;
            schema::migrate(&pool)
                .await
                .map_err(|e| sqlx::Error::Protocol(e.to_string()))?;
            pool.close().await;
            sqlx::query(AssertSqlSafe(format!(
                "ALTER DATABASE {build_name} WITH IS_TEMPLATE true ALLOW_CONNECTIONS false"
            )))
            .execute(&mut *conn)
            .await?;
            Ok(())
        })
    })
    .await
    .unwrap_or_else(|e| panic!("building template database {name}: {e}"));
    name
}

/// The isolation level a new transaction on `pool` runs at (`read committed`, …).
async fn isolation_of(pool: &PgPool) -> String {
    sqlx::query_scalar("SHOW transaction_isolation")
        .fetch_one(pool)
        .await
        .expect("SHOW transaction_isolation")
}

/// The statements of `pool`'s database's sessions that wait for a lock (a request blocked on a
/// row a test holds).
pub async fn lock_waiting_statements(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT query FROM pg_stat_activity WHERE datname = current_database() \
         AND wait_event_type = 'Lock'",
    )
    .fetch_all(pool)
    .await
    .unwrap_or_else(|e| panic!("reading pg_stat_activity: {e}"))
}

/// Asserts that the pools `build` makes on a database whose default isolation is `repeatable
/// read` run READ COMMITTED all the same, while a plain pool on it gets the default.
pub async fn assert_pools_pin_read_committed(build: impl FnOnce(&TestDb) -> Vec<PgPool>) {
    let db = TestDb::new().await;
    db.set_default_isolation("repeatable read").await;
    for pool in build(&db) {
        assert_eq!(isolation_of(&pool).await, "read committed");
    }
    assert_eq!(
        isolation_of(&db.pool_with(1).await).await,
        "repeatable read",
        "the database's default applies without the settings"
    );
}
