//! A private PostgreSQL server for the tests: `initdb` into a temporary directory,
//! started with `pg_ctl` on a free loopback port (as the `postgres` user when the tests
//! run as root, since PostgreSQL refuses to run as root), and stopped when the test
//! process ends — by a watchdog process, since a test binary's statics are never
//! dropped. One server per test process, started on first use; each store gets a
//! schema of its own. The server's binaries are found on `PATH` or under
//! `/usr/lib/postgresql/*/bin`. A server that cannot start fails the test with the
//! reason (never a silent skip).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use proctor::{PgOptions, PgStore};

/// The running server.
pub struct Postgres {
    pub port: u16,
    data: PathBuf,
    bin: PathBuf,
    user: Option<String>,
}

static SERVER: OnceLock<Result<Postgres, String>> = OnceLock::new();

/// The test process's server, started on first use.
pub fn server() -> &'static Postgres {
    match SERVER.get_or_init(Postgres::start) {
        Ok(server) => server,
        Err(reason) => panic!("cannot start a private PostgreSQL for the tests: {reason}"),
    }
}

/// A store on the test process's server, in a schema of its own.
pub fn store() -> PgStore {
    let schema = fresh_schema();
    store_in(&schema)
}

/// A store on the test process's server in `schema` (the same schema is the same
/// store, as a reopened WAL directory is).
pub fn store_in(schema: &str) -> PgStore {
    let options = PgOptions::default().schema(schema);
    PgStore::connect_with(&server().url(), options).expect("PostgreSQL store opens")
}

/// A schema name no other store of this process has.
pub fn fresh_schema() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("t{}", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// The role that must sign in with a password (`PASSWORD`), for tests of credentials.
pub const PASSWORD_ROLE: &str = "proctor_password";
/// Its password, once a test has created it ([`Postgres::password_url`]).
pub const PASSWORD: &str = "right horse battery staple";

impl Postgres {
    /// Creates [`PASSWORD_ROLE`] (once), allowed to create schemas in the database: a
    /// connection string for it with `password`.
    pub fn password_url(&self, password: &str) -> String {
        let mut sql = postgres::Client::connect(&self.url(), postgres::NoTls).expect("connect");
        sql.batch_execute(&format!(
            "DO $$ BEGIN
               IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{PASSWORD_ROLE}') THEN
                 CREATE ROLE {PASSWORD_ROLE} LOGIN PASSWORD '{PASSWORD}';
                 GRANT CREATE ON DATABASE postgres TO {PASSWORD_ROLE};
               END IF;
             END $$"
        ))
        .expect("create the password role");
        format!(
            "host=127.0.0.1 port={} user={PASSWORD_ROLE} password='{password}' dbname=postgres connect_timeout=10",
            self.port
        )
    }

    /// The connection string of its `postgres` database, as its superuser.
    pub fn url(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres connect_timeout=10",
            self.port
        )
    }

    fn start() -> Result<Postgres, String> {
        let bin = find_bin()?;
        let user = if is_root() {
            Some("postgres".to_string())
        } else {
            None
        };
        let data = std::env::temp_dir().join(format!(
            "proctor-pg-{}-{}",
            std::process::id(),
            fresh_schema()
        ));
        std::fs::create_dir_all(&data).map_err(|e| format!("{}: {e}", data.display()))?;
        if let Some(user) = &user {
            chown(&data, user)?;
        }
        let server = Postgres {
            port: free_port()?,
            data,
            bin,
            user,
        };
        server.watch();
        let pgdata = server.data.join("db");
        server.run(
            "initdb",
            &[
                "-D",
                path_str(&pgdata)?,
                "-U",
                "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--no-sync",
            ],
        )?;
        // One role signs in with a password (first match wins): the tests of wrong
        // credentials use it; every other connection is trusted.
        let hba = pgdata.join("pg_hba.conf");
        let trusted =
            std::fs::read_to_string(&hba).map_err(|e| format!("{}: {e}", hba.display()))?;
        std::fs::write(
            &hba,
            format!("host all {PASSWORD_ROLE} 127.0.0.1/32 scram-sha-256\n{trusted}"),
        )
        .map_err(|e| format!("{}: {e}", hba.display()))?;
        server.pg_ctl(&["start", "-w", "-t", "60"])?;
        Ok(server)
    }

    /// Restarts the server, as an operator's `pg_ctl restart -m fast` does.
    pub fn restart(&self) -> Result<(), String> {
        self.pg_ctl(&["restart", "-m", "fast", "-w", "-t", "60"])
    }

    fn pg_ctl(&self, args: &[&str]) -> Result<(), String> {
        let pgdata = self.data.join("db");
        let log = self.data.join("server.log");
        // Loopback only, sockets in its own directory, and no fsync (a test server's
        // data lives as long as the test process).
        let options = format!(
            "-c listen_addresses=127.0.0.1 -c port={} -c unix_socket_directories={} \
             -c fsync=off -c full_page_writes=off -c max_connections=200",
            self.port,
            path_str(&self.data)?
        );
        let mut all = vec![
            "-D",
            path_str(&pgdata)?,
            "-l",
            path_str(&log)?,
            "-o",
            &options,
        ];
        all.extend_from_slice(args);
        self.run("pg_ctl", &all).map_err(|e| {
            format!(
                "{e}\nserver log:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            )
        })
    }

    /// Runs one of the server's programs, as its user.
    fn run(&self, program: &str, args: &[&str]) -> Result<(), String> {
        let exe = self.bin.join(program);
        let mut command = match &self.user {
            Some(user) => {
                let mut c = Command::new("runuser");
                c.args(["-u", user, "--"]).arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        let out = command
            .args(args)
            .current_dir(&self.data)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("running {}: {e}", exe.display()))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "{} {} failed ({}): {}{}",
                exe.display(),
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }

    /// Starts a watchdog that stops the server and removes its directory once this
    /// process has exited.
    fn watch(&self) {
        let pg_ctl = self.bin.join("pg_ctl");
        let as_user = match &self.user {
            Some(user) => format!("runuser -u {user} -- "),
            None => String::new(),
        };
        let script = format!(
            "while kill -0 {pid} 2>/dev/null; do sleep 0.2; done; \
             {as_user}'{pg_ctl}' -D '{data}/db' stop -m immediate >/dev/null 2>&1; \
             rm -rf '{data}'",
            pid = std::process::id(),
            pg_ctl = pg_ctl.display(),
            data = self.data.display(),
        );
        let _ = Command::new("sh")
            .args(["-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
    }
}

/// The directory of `initdb` and `pg_ctl`: on `PATH`, or the newest
/// `/usr/lib/postgresql/<version>/bin`.
fn find_bin() -> Result<PathBuf, String> {
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>());
    for dir in on_path {
        if dir.join("initdb").is_file() && dir.join("pg_ctl").is_file() {
            return Ok(dir);
        }
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .map_err(|e| format!("no initdb on PATH, and /usr/lib/postgresql: {e}"))?
        .filter_map(|e| {
            let e = e.ok()?;
            let version = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").is_file().then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions
        .pop()
        .map(|(_, bin)| bin)
        .ok_or_else(|| "no initdb on PATH or under /usr/lib/postgresql/*/bin".to_string())
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).trim() == "0")
}

fn chown(path: &Path, user: &str) -> Result<(), String> {
    let out = Command::new("chown")
        .arg(user)
        .arg(path)
        .output()
        .map_err(|e| format!("chown {user} {}: {e}", path.display()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "chown {user} {}: {} (PostgreSQL runs as {user} when the tests run as root)",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

fn free_port() -> Result<u16, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("a free port: {e}"))?;
    listener
        .local_addr()
        .map(|a| a.port())
        .map_err(|e| format!("a free port: {e}"))
}

fn path_str(path: &Path) -> Result<&str, String> {
    path.to_str()
        .ok_or_else(|| format!("{} is not UTF-8", path.display()))
}
