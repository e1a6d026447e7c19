// graphile-worker's burn-down of pre-inserted no-op jobs, the peer reference for
// `cargo xtask bench queue` (docs/benchmarks.md): `npm ci && npm run bench`.
// Settings as the queue issue names its fastest: a local queue of 500 jobs and immediately
// batched completions. Environment: DATABASE_URL (a server; the database `fairlane_peer_graphile`
// is created on it and dropped after), JOBS (100000), CONCURRENCY (24).
const { run, runMigrations } = require("graphile-worker");
const { Pool } = require("pg");

const server = process.env.DATABASE_URL || "postgres://postgres@127.0.0.1:5432/postgres";
const jobs = Number(process.env.JOBS || 100000);
const concurrency = Number(process.env.CONCURRENCY || 24);
const database = "fairlane_peer_graphile";

function onDatabase(url, name) {
  const parsed = new URL(url);
  parsed.pathname = `/${name}`;
  parsed.search = "";
  return parsed.toString();
}

async function main() {
  const admin = new Pool({ connectionString: onDatabase(server, "postgres"), max: 1 });
  await admin.query(`DROP DATABASE IF EXISTS ${database} WITH (FORCE)`);
  await admin.query(`CREATE DATABASE ${database}`);
  const connectionString = onDatabase(server, database);
  const pool = new Pool({ connectionString, max: 1 });
  // The workers' own pool, so that it is closed before the database is dropped.
  const workerPool = new Pool({ connectionString, max: 10 });
  // Ended pools' clients may still be closing when the database is dropped at the end.
  const ignore = () => {};
  for (const p of [pool, workerPool]) {
    p.on("error", ignore);
    p.on("connect", (client) => client.on("error", ignore));
  }
  try {
    await runMigrations({ pgPool: workerPool });
    const insertStart = Date.now();
    await pool.query(
      `SELECT graphile_worker.add_jobs(array(
         SELECT row('noop', json_build_object('i', i), null, null, null, null, null, null)
                ::graphile_worker.job_spec
         FROM generate_series(1, $1) i))`,
      [jobs],
    );
    const insertSeconds = (Date.now() - insertStart) / 1000;
    await pool.query("CHECKPOINT");
    const start = Date.now();
    const runner = await run({
      pgPool: workerPool,
      concurrency,
      noHandleSignals: true,
      pollInterval: 1000,
      preset: {
        worker: { localQueue: { size: 500 }, completeJobBatchDelay: 0, failJobBatchDelay: 0 },
      },
      taskList: { noop: async () => {} },
    });
    // Completed jobs are deleted: the burn-down ends when the table is empty. An EXISTS probe
    // every 100 ms, as Fairlane's bench watches its own, so that watching costs the peer little.
    for (;;) {
      const { rows } = await pool.query(
        "SELECT EXISTS (SELECT 1 FROM graphile_worker._private_jobs) AS left",
      );
      if (!rows[0].left) break;
      await new Promise((resolve) => setTimeout(resolve, 100));
    }
    const seconds = (Date.now() - start) / 1000;
    await runner.stop();
    await runner.promise;
    console.log(`| graphile-worker 0.18.0, concurrency ${concurrency} | add_jobs ${jobs}: ` +
      `${Math.round(jobs / insertSeconds)} jobs/s | burn-down: ${Math.round(jobs / seconds)} ` +
      `jobs/s (${seconds.toFixed(2)} s) |`);
  } finally {
    await workerPool.end();
    await pool.end();
    await admin.query(`DROP DATABASE IF EXISTS ${database} WITH (FORCE)`);
    await admin.end();
  }
}

main().catch((error) => {
  console.error(`graphile-worker burn-down: ${error.message}`);
  process.exit(1);
});
