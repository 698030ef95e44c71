//! The operator's web page (the `admin` feature): a small axum server over a running
//! executor's handle. HBase's Procedures & Locks page, for proctor.
//!
//! Pages (server-rendered HTML with a little JavaScript, every asset served from here)
//! and the same routes as JSON with `Accept: application/json`:
//!
//! - `/procedures` — every procedure, newest first, filtered by `state`, `type` and
//!   `tree`, a page at a time (`page`, `per_page`), live through `/events`;
//! - `/procedures/{id}` — the tree `id` is in, parent above children, with its
//!   execution stack and the steps its rollback undid so far ([`Executor::tree`]), and
//!   each DAG's tasks and edges;
//! - `/locks` — each resource with its holders, its queue in the order it is served
//!   and its permits, and the wait-for cycles the engine handled ([`Executor::locks`]);
//! - `/engine` — workers and queues per shard, the executor's role (alone, leader,
//!   standby, a cluster partition's owner, stepped down), the store's figures, the
//!   group commit's batch sizes and the latest failures ([`Executor::engine_status`]);
//!   with [`AdminConfig::cluster`](crate::admin::AdminConfig::cluster) (the `postgres`
//!   feature), the cluster too: its coordinator, members, partitions with their owners
//!   and epochs, and newest moves, read from its store at each request;
//! - `/events` — the live feed as Server-Sent Events: once a tick, what the engine
//!   published since (counts, the newest roots, the watched rows that changed).
//!
//! Actions (`POST /procedures/{id}/abort`, `pause`, `resume` (or `continue`), `rollback`, `bypass`,
//! `force-bypass` — [`Executor::force_bypass`], for a procedure stuck in a step)
//! need the bearer token the embedding service set ([`AdminConfig::token`](crate::admin::AdminConfig::token); without
//! one the page is read-only), in `Authorization: Bearer <token>`. A request from a
//! browser (one with an `Origin`, a `Sec-Fetch-Site` or cookies) needs the page's CSRF
//! token too (`x-csrf-token`, which the page's script sends): what a browser attaches
//! by itself must not let another page act. A client that is no browser (a script,
//! `curl`, another service) needs the bearer token alone: no page of another origin
//! can make a browser send it. A request without a token is answered 401, a wrong
//! token 403, a browser's without the CSRF token 403; the engine's refusal comes back
//! as it says it (409). Every action is logged at INFO with who asked and what.
//!
//! What every request is checked for, first (so that a page elsewhere on the web, one
//! that rebinds its own DNS name to this address, can neither read the page nor act):
//!
//! - its `Host` names the address the page serves on (`127.0.0.1:9092`; on a loopback
//!   address `localhost:9092` too; behind a listener bound to every interface, the
//!   interface's address the connection came to) or a host the service allowed
//!   ([`AdminConfig::allow_host`](crate::admin::AdminConfig::allow_host): a name on
//!   any port, or `name:port`). Anything else, or no Host, is answered 421 Misdirected
//!   Request with a line saying why: the request names a server this is not (a 403
//!   would say it was understood and refused), and it is logged at WARN. A
//!   [`router`](crate::admin::router) nested in a service's own server does not know
//!   that server's address: it answers only the hosts its config allows, so the
//!   service names every `host:port` and name its operators use;
//! - an action's `Origin`, if it has one (a browser sends one), is an allowed host's:
//!   else 403, before its tokens are looked at.
//!
//! Every answer carries `X-Frame-Options: DENY`, `X-Content-Type-Options: nosniff`,
//! `Referrer-Policy: no-referrer` and `Content-Security-Policy: default-src 'self';
//! object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'`:
//! the page loads its script, stylesheet and live feed from its own routes, has no
//! inline script, style or handler, and shows in no other page's frame.
//!
//! ```no_run
//! # async fn f(executor: proctor::Executor) -> std::io::Result<()> {
//! use proctor::admin::AdminConfig;
//! // Stand-alone on 127.0.0.1:9092 (answering 127.0.0.1:9092 and localhost:9092),
//! // actions allowed with the token:
//! AdminConfig::default().token("s3cret").serve(executor).await?;
//! # Ok(()) }
//! ```

mod guard;
mod live;
mod pages;

use std::hash::{BuildHasher, Hasher};
use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{ConnectInfo, OriginalUri, Path, Query, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::{Executor, List, ProcId, ProcInfo, ProcState, Role, WaitingOn};

/// How the admin page runs: where it listens stand-alone, the token actions need, the
/// host names it answers for besides its own address, and the cluster it shows.
#[derive(Clone, Debug)]
pub struct AdminConfig {
    addr: SocketAddr,
    token: Option<String>,
    live_every: std::time::Duration,
    hosts: Vec<String>,
    #[cfg(feature = "postgres")]
    cluster: Option<ClusterSource>,
}

impl Default for AdminConfig {
    /// Loopback port 9092, read-only, no cluster.
    fn default() -> Self {
        AdminConfig {
            addr: SocketAddr::from(([127, 0, 0, 1], 9092)),
            token: None,
            live_every: std::time::Duration::from_millis(500),
            hosts: Vec::new(),
            #[cfg(feature = "postgres")]
            cluster: None,
        }
    }
}

/// Where the page reads a cluster from ([`AdminConfig::cluster`]).
#[cfg(feature = "postgres")]
#[derive(Clone)]
struct ClusterSource {
    url: String,
    options: crate::PgOptions,
}

#[cfg(feature = "postgres")]
impl std::fmt::Debug for ClusterSource {
    /// Without the URL, which may carry a password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterSource")
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl AdminConfig {
    /// Where [`serve`](Self::serve) listens (127.0.0.1:9092 by default).
    #[must_use]
    pub fn addr(mut self, addr: SocketAddr) -> Self {
        self.addr = addr;
        self
    }

    /// The bearer token actions need; without one the page is read-only.
    #[must_use]
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// How often the live feed writes a line (500 ms by default; at least 10 ms).
    /// Each line folds everything the engine published since the last.
    #[must_use]
    pub fn live_every(mut self, every: std::time::Duration) -> Self {
        self.live_every = every.max(std::time::Duration::from_millis(10));
        self
    }

    /// A `Host` the page answers for, besides the address it serves on: the name (or
    /// address) its operators reach it by through a proxy, a DNS name, or, for a
    /// [`router`] nested in a service's own server, the service's address. Call it once
    /// per host.
    ///
    /// `host` is `name` or `name:port` (`[v6]:port` for IPv6), compared without case.
    /// A name without a port is answered on any port — what keeps a page elsewhere from
    /// reading this one is the name its browser sends, never the port — and one with a
    /// port on that port only (a request without a port names port 80; an `Origin`,
    /// its scheme's). A `host` that is no such thing allows nothing and is logged.
    ///
    /// ```no_run
    /// # async fn f(executor: proctor::Executor) -> std::io::Result<()> {
    /// use proctor::admin::AdminConfig;
    /// // On every interface, reached as http://ops.example.com:9092 or through a
    /// // TLS proxy as https://ops.example.com:
    /// AdminConfig::default()
    ///     .addr("0.0.0.0:9092".parse().unwrap())
    ///     .allow_host("ops.example.com")
    ///     .serve(executor)
    ///     .await?;
    /// # Ok(()) }
    /// ```
    #[must_use]
    pub fn allow_host(mut self, host: impl Into<String>) -> Self {
        self.hosts.push(host.into());
        self
    }

    /// Shows the [cluster](crate::Cluster) whose store is at `url` (a `postgresql://`
    /// URL or libpq key-values, in the schema `options` names) on the engine page and
    /// in its JSON, as `cluster`: the coordinator, each member (its epoch, live or
    /// expired, the time its membership has left), each partition (its owner, epoch,
    /// pending hand-off and moves) and the newest moves — `null` if the schema holds
    /// no cluster, `{"error": ...}` if the store cannot be read (the rest of the page
    /// is still answered). The page served is usually one of the member's engines
    /// ([`Cluster::engine`](crate::Cluster::engine)); the cluster is read from the
    /// store's tables ([`PgStore::inspect_cluster`](crate::PgStore::inspect_cluster)),
    /// on a connection of its own, on a blocking thread, at each request of `/engine`.
    /// Read-only: the page changes nothing in the cluster, and its actions still act on
    /// the one engine it serves. The `postgres` feature.
    ///
    /// ```no_run
    /// # async fn f(cluster: proctor::Cluster) -> std::io::Result<()> {
    /// use proctor::admin::AdminConfig;
    /// use proctor::PgOptions;
    /// let engine = cluster.engine(cluster.owned()[0]).expect("it owns the partition");
    /// AdminConfig::default()
    ///     .cluster("postgresql://ops@db.internal/app", PgOptions::default().schema("orders"))
    ///     .serve(engine)
    ///     .await?;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "postgres")]
    #[must_use]
    pub fn cluster(mut self, url: impl Into<String>, options: crate::PgOptions) -> Self {
        self.cluster = Some(ClusterSource {
            url: url.into(),
            options,
        });
        self
    }

    /// Serves [`router`] on the configured address until the process ends.
    ///
    /// # Errors
    /// The address cannot be bound.
    pub async fn serve<E: Send + Sync + 'static>(
        self,
        executor: Executor<E>,
    ) -> std::io::Result<()> {
        let listener = tokio::net::TcpListener::bind(self.addr).await?;
        self.serve_on(listener, executor).await
    }

    /// Serves [`router`] on `listener` (one bound to port 0, say) until the process
    /// ends; the configured address is not used.
    ///
    /// Besides the hosts [`allow_host`](Self::allow_host) named, it answers a request
    /// whose `Host` is the address its connection came to (`127.0.0.1:9092`, say; on a
    /// listener bound to every interface, the interface's address), and on a loopback
    /// address `localhost` on its port.
    ///
    /// # Errors
    /// The listener fails.
    pub async fn serve_on<E: Send + Sync + 'static>(
        self,
        listener: tokio::net::TcpListener,
        executor: Executor<E>,
    ) -> std::io::Result<()> {
        let app = build(executor, self);
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<guard::Served>(),
        )
        .await
    }
}

/// What every handler shares.
struct Admin<E: Send + Sync + 'static> {
    executor: Executor<E>,
    token: Option<String>,
    /// The pages' CSRF token, made when the router is.
    csrf: String,
    live_every: std::time::Duration,
    /// The cluster the engine page shows, if any.
    #[cfg(feature = "postgres")]
    cluster: Option<ClusterSource>,
}

type Shared<E> = State<Arc<Admin<E>>>;

/// The admin routes over `executor`, to nest under a service's own router (or to
/// [`serve`](AdminConfig::serve) alone).
///
/// Nest it with `nest_service`: then the prefix, with or without its slash (`/admin`,
/// `/admin/`), leads to the procedures page, and everything the pages link to (pages,
/// stylesheet, script, live feed, actions) is relative, so it stays under the prefix.
/// (axum's `Router::nest` routes nothing at `/admin/`; `/admin` still leads to the
/// procedures page.)
///
/// Nested, the router cannot know the address the service's server listens on: it
/// answers only the hosts the config names ([`AdminConfig::allow_host`]) — every
/// `host:port` and name the operators' browsers reach the service by — and refuses
/// every other request with 421 (with none named, every request, which is logged
/// here). Each answer carries the security headers the module docs list.
///
/// ```no_run
/// # fn f(executor: proctor::Executor) {
/// use proctor::admin::{router, AdminConfig};
/// let admin = router(executor, AdminConfig::default().allow_host("10.0.0.5:8080"));
/// let app: axum::Router = axum::Router::new().nest_service("/admin", admin);
/// # }
/// ```
pub fn router<E: Send + Sync + 'static>(executor: Executor<E>, config: AdminConfig) -> Router {
    if config.hosts.is_empty() {
        tracing::warn!(target: crate::targets::ADMIN, "the admin router allows no host and refuses every request: name the service's hosts with AdminConfig::allow_host");
    }
    build(executor, config)
}

/// The routes behind the guard: the hosts the config names, and (through
/// [`serve_on`](AdminConfig::serve_on)'s connections) the address each request came to.
fn build<E: Send + Sync + 'static>(executor: Executor<E>, config: AdminConfig) -> Router {
    let guard = Arc::new(guard::Guard::new(&config.hosts));
    let admin = Arc::new(Admin {
        executor,
        token: config.token,
        csrf: random_token(),
        live_every: config.live_every,
        #[cfg(feature = "postgres")]
        cluster: config.cluster,
    });
    Router::new()
        .route("/", get(to_procedures))
        .route("/procedures", get(procedures::<E>))
        .route("/procedures/{id}", get(tree::<E>))
        .route("/procedures/{id}/{action}", post(action::<E>))
        .route("/locks", get(locks::<E>))
        .route("/engine", get(engine::<E>))
        .route("/events", get(events::<E>))
        .route(
            "/assets/admin.css",
            get(|| async { asset("text/css", pages::CSS) }),
        )
        .route(
            "/assets/admin.js",
            get(|| async { asset("text/javascript", pages::JS) }),
        )
        .with_state(admin)
        .layer(axum::middleware::from_fn_with_state(guard, guard::check))
}

/// The admin root leads to the procedures page, by a relative redirect so that it
/// works wherever the router is nested: from `/admin/` (or `/` alone) to
/// `procedures`, from `/admin` to `admin/procedures`.
async fn to_procedures(OriginalUri(uri): OriginalUri) -> Redirect {
    let path = uri.path();
    match path.rsplit_once('/') {
        Some((_, last)) if !last.is_empty() => Redirect::to(&format!("{last}/procedures")),
        _ => Redirect::to("procedures"),
    }
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    ([(header::CONTENT_TYPE, content_type)], body).into_response()
}

/// 128 random bits, hex (from the standard library's per-process random keys).
fn random_token() -> String {
    let half = || {
        std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish()
    };
    format!("{:016x}{:016x}", half(), half())
}

/// An error answered with its status and message (never a 500 for bad input).
struct Refusal(StatusCode, String);

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        (self.0, Json(json!({ "error": self.1 }))).into_response()
    }
}

fn bad_request(message: impl Into<String>) -> Refusal {
    Refusal(StatusCode::BAD_REQUEST, message.into())
}

fn engine_error(e: &crate::Error) -> Refusal {
    let status = match e {
        crate::Error::UnknownProcedure(_) | crate::Error::Gone(_) => StatusCode::NOT_FOUND,
        crate::Error::NotLeader { .. } | crate::Error::Stopped => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::CONFLICT,
    };
    Refusal(status, e.to_string())
}

fn wants_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::ACCEPT)
        .and_then(|a| a.to_str().ok())
        .is_some_and(|a| a.contains("application/json"))
}

/// A procedure as JSON (the shape of `proctor procs --json`'s lines, for what a
/// running engine knows).
fn proc_json(p: &ProcInfo) -> Value {
    json!({
        "id": p.id.0,
        "parent": p.parent.map(|id| id.0),
        "root": p.root.0,
        "type": p.type_name,
        "state": p.state.to_string(),
        "steps": p.steps,
        "state_name": p.state_name,
        "submitted_ms": p.submitted_ms,
        "updated_ms": p.updated_ms,
        "waiting_for": waiting_json(p),
        "locks_held": p.locks_held.iter().map(ToString::to_string).collect::<Vec<_>>(),
        "locks_waiting": p.locks_waiting.iter().map(ToString::to_string).collect::<Vec<_>>(),
        "queue_level": p.queue_level,
        "failure": p.result.as_ref().and_then(|r| r.as_ref().err()).map(ToString::to_string),
        "bypassed": p.bypassed,
        "steering": p.steering,
    })
}

fn waiting_json(p: &ProcInfo) -> Value {
    match &p.waiting_on {
        None => Value::Null,
        Some(WaitingOn::Children) => json!("children"),
        Some(WaitingOn::Event(event)) => json!({ "event": event }),
        Some(WaitingOn::Timer { at_ms }) => json!({ "timer_ms": at_ms }),
        Some(WaitingOn::Locks) => json!("locks"),
    }
}

#[derive(Deserialize, Default)]
struct Filters {
    state: Option<String>,
    #[serde(rename = "type")]
    type_name: Option<String>,
    tree: Option<String>,
    page: Option<String>,
    per_page: Option<String>,
}

/// The filters, checked: a bad one is a 400 that says what was wrong.
struct Checked {
    state: Option<ProcState>,
    type_name: Option<String>,
    tree: Option<ProcId>,
    page: usize,
    per_page: usize,
}

fn check(filters: Filters) -> Result<Checked, Refusal> {
    let blank = |s: Option<String>| s.filter(|s| !s.trim().is_empty());
    let state = blank(filters.state)
        .map(|name| name.parse::<ProcState>())
        .transpose()
        .map_err(|e| bad_request(e.to_string()))?;
    let number = |name: &str, value: Option<String>, default: u64, max: u64| match blank(value) {
        None => Ok(default),
        Some(v) => v
            .trim()
            .parse::<u64>()
            .ok()
            .filter(|n| (1..=max).contains(n))
            .ok_or_else(|| {
                bad_request(format!(
                    "{name} must be a number from 1 to {max}, not {v:?}"
                ))
            }),
    };
    let tree = match blank(filters.tree) {
        None => None,
        Some(t) => Some(ProcId(number("tree", Some(t), 1, u64::MAX)?)),
    };
    Ok(Checked {
        state,
        type_name: blank(filters.type_name),
        tree,
        page: usize::try_from(number("page", filters.page, 1, 1_000_000)?).unwrap_or(1),
        per_page: usize::try_from(number("per_page", filters.per_page, 100, 1000)?).unwrap_or(100),
    })
}

async fn procedures<E: Send + Sync + 'static>(
    State(admin): Shared<E>,
    Query(filters): Query<Filters>,
    headers: HeaderMap,
) -> Result<Response, Refusal> {
    let checked = check(filters)?;
    let mut list = List::new().with_finished();
    if let Some(state) = checked.state {
        list = list.state(state);
    }
    if let Some(name) = &checked.type_name {
        list = list.type_name(name.clone());
    }
    if let Some(tree) = checked.tree {
        list = list.root(tree);
    }
    let offset = (checked.page - 1).saturating_mul(checked.per_page);
    let page = admin
        .executor
        .list_page(list, offset, checked.per_page)
        .await
        .map_err(|e| engine_error(&e))?;
    let (total, shown) = (page.total, &page.procedures);
    if wants_json(&headers) {
        let procedures: Vec<Value> = shown.iter().map(proc_json).collect();
        return Ok(Json(json!({
            "procedures": procedures,
            "total": total,
            "page": checked.page,
            "per_page": checked.per_page,
        }))
        .into_response());
    }
    let view = pages::ProcView {
        state: checked.state.map(|s| s.to_string()).unwrap_or_default(),
        type_name: checked.type_name.unwrap_or_default(),
        tree: checked.tree.map(|t| t.0.to_string()).unwrap_or_default(),
        page: checked.page,
        per_page: checked.per_page,
        total,
    };
    Ok(pages::html(
        &admin.csrf,
        "",
        "Procedures",
        &pages::procedures(&view, shown, &ProcState::ALL),
    )
    .into_response())
}

fn parse_id(id: &str) -> Result<ProcId, Refusal> {
    id.parse::<u64>()
        .map(ProcId)
        .map_err(|_| bad_request(format!("not a procedure id: {id:?}")))
}

async fn tree<E: Send + Sync + 'static>(
    State(admin): Shared<E>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, Refusal> {
    let id = parse_id(&id)?;
    let info = admin
        .executor
        .state(id)
        .await
        .map_err(|e| engine_error(&e))?;
    let mut procs = admin
        .executor
        .list(List::new().with_finished().root(info.root))
        .await
        .map_err(|e| engine_error(&e))?;
    procs.sort_unstable_by_key(|p| p.id);
    // A finished tree has no stack left; a live one answers with its own.
    let stack = match admin.executor.tree(info.root).await {
        Ok(stack) => Some(stack),
        Err(crate::Error::Finished { .. }) => None,
        Err(e) => return Err(engine_error(&e)),
    };
    let dags = pages::dags(&procs);
    if wants_json(&headers) {
        let procedures: Vec<Value> = procs.iter().map(proc_json).collect();
        let ids = |ids: &[ProcId]| ids.iter().map(|p| p.0).collect::<Vec<_>>();
        let stack_json = stack.as_ref().map(|t| {
            json!({
                "stack": ids(&t.stack),
                "rolling_back": t.rolling_back,
                "rolled_back": ids(&t.rolled_back),
            })
        });
        let dags_json: Vec<Value> = dags.iter().map(pages::Dag::json).collect();
        return Ok(Json(json!({
            "root": info.root.0,
            "procedures": procedures,
            "execution": stack_json,
            "dags": dags_json,
        }))
        .into_response());
    }
    let title = format!("Tree {}", info.root);
    let body = pages::tree(info.root, &procs, id, stack.as_ref(), &dags);
    Ok(pages::html(&admin.csrf, "../", &title, &body).into_response())
}

/// Each resource with its holders and its queue, the standing cycles and the latest
/// cycles the engine handled.
async fn locks<E: Send + Sync + 'static>(
    State(admin): Shared<E>,
    headers: HeaderMap,
) -> Result<Response, Refusal> {
    let report = admin.executor.locks().await.map_err(|e| engine_error(&e))?;
    if wants_json(&headers) {
        return Ok(Json(pages::locks_json(&report)).into_response());
    }
    Ok(pages::html(&admin.csrf, "", "Locks", &pages::locks(&report)).into_response())
}

async fn engine<E: Send + Sync + 'static>(
    State(admin): Shared<E>,
    headers: HeaderMap,
) -> Result<Response, Refusal> {
    let stats = admin
        .executor
        .scheduler_stats()
        .await
        .map_err(|e| engine_error(&e))?;
    let status = admin
        .executor
        .engine_status()
        .await
        .map_err(|e| engine_error(&e))?;
    let role = match admin.executor.role().await {
        Ok(Role::Alone) => json!({ "role": "alone" }),
        Ok(Role::Leader { holder, epoch }) => {
            json!({ "role": "leader", "holder": holder, "epoch": epoch })
        }
        Ok(Role::Standby { leader }) => json!({ "role": "standby", "leader": leader }),
        Ok(Role::SteppedDown { reason }) => json!({ "role": "stepped_down", "reason": reason }),
        Ok(Role::Owner {
            holder,
            partition,
            epoch,
        }) => json!({ "role": "owner", "holder": holder, "partition": partition, "epoch": epoch }),
        Err(e) => json!({ "role": "unknown", "error": e.to_string() }),
    };
    let recovery = admin.executor.recovery();
    let per_shard: Vec<Value> = stats
        .per_shard
        .iter()
        .map(|s| json!({ "workers": s.workers, "running": s.running, "queued": s.queued }))
        .collect();
    let store: serde_json::Map<String, Value> = status
        .store
        .facts
        .iter()
        .map(|(k, v)| ((*k).to_string(), Value::from(v.as_str())))
        .collect();
    let commits = &status.commits;
    let failures: Vec<Value> = status
        .recent_failures
        .iter()
        .map(|f| {
            json!({
                "at_ms": f.at_ms,
                "root": f.root.0,
                "type": f.type_name,
                "failed": f.failure.proc.0,
                "failed_type": f.failure.type_name,
                "error": f.failure.error.to_string(),
            })
        })
        .collect();
    let mut body = json!({
        "shards": stats.shards,
        "workers": stats.workers,
        "running": stats.running,
        "queued": stats.queued,
        "queued_by_level": stats.queued_by_level,
        "system_workers": stats.system_workers,
        "running_system": stats.running_system,
        "queued_system": stats.queued_system,
        "per_shard": per_shard,
        "lock_holders": stats.lock_holders,
        "lock_waiters": stats.lock_waiters,
        "events": stats.events,
        "trees_active": stats.trees_active,
        "trees_passivated": stats.trees_passivated,
        "leadership": role,
        "recovered_roots": recovery.recovered_roots.len(),
        "corrupt": recovery.corrupt.len(),
        "store": { "kind": status.store.kind, "facts": store },
        "commits": {
            "batches": commits.batches,
            "records": commits.records,
            "mean_records": commits.mean_records(),
            "largest": commits.largest,
            "by_size": commits.by_size,
            "append_ms": commits.append_time.as_secs_f64() * 1e3,
        },
        "recent_failures": failures,
    });
    if let Some(cluster) = cluster_of(&admin).await {
        body["cluster"] = cluster;
    }
    if wants_json(&headers) {
        return Ok(Json(body).into_response());
    }
    Ok(pages::html(&admin.csrf, "", "Engine", &pages::engine(&body)).into_response())
}

/// The cluster as the engine page shows it, if the config names one: its state (see
/// [`pages::cluster_json`]), `null` if the schema holds no cluster, or
/// `{"error": ...}`. Read on a blocking thread: the store's client blocks.
#[cfg(feature = "postgres")]
async fn cluster_of<E: Send + Sync + 'static>(admin: &Admin<E>) -> Option<Value> {
    let source = admin.cluster.clone()?;
    let read = tokio::task::spawn_blocking(move || {
        crate::PgStore::inspect_cluster(&source.url, &source.options)
    })
    .await;
    Some(match read {
        Ok(Ok(Some(state))) => pages::cluster_json(&state),
        Ok(Ok(None)) => Value::Null,
        Ok(Err(e)) => {
            tracing::warn!(target: crate::targets::ADMIN, error = %e, "the admin page could not read the cluster");
            json!({ "error": format!("reading the cluster: {e}") })
        }
        Err(e) => json!({ "error": format!("reading the cluster: {e}") }),
    })
}

/// Without the PostgreSQL store there is no cluster to show.
#[cfg(not(feature = "postgres"))]
async fn cluster_of<E: Send + Sync + 'static>(_: &Admin<E>) -> Option<Value> {
    None
}

#[derive(Deserialize, Default)]
struct EventsQuery {
    watch: Option<String>,
    new: Option<bool>,
}

/// The live feed, as Server-Sent Events: the engine's subscription folded into one
/// `data:` line per tick (see [`live`]). `watch` names the rows the page shows,
/// `new=true` asks for the newest roots.
async fn events<E: Send + Sync + 'static>(
    State(admin): Shared<E>,
    Query(query): Query<EventsQuery>,
) -> Result<Response, Refusal> {
    use futures_util::StreamExt;
    let interest = live::Interest::parse(query.watch.as_deref(), query.new).map_err(bad_request)?;
    let events = admin
        .executor
        .subscribe()
        .await
        .map_err(|e| engine_error(&e))?;
    let every = admin.live_every;
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Whatever events are ready are folded in as one burst.
    let events = events.ready_chunks(512);
    let feed = live::Feed::new(interest);
    let stream = futures_util::stream::unfold(
        Some((events, feed, ticks)),
        move |state| async move {
            let (mut events, mut feed, mut ticks) = state?;
            loop {
                tokio::select! {
                    _ = ticks.tick() => {
                        if let Some(line) = feed.flush(every, false) {
                            return Some((Ok::<_, std::convert::Infallible>(line), Some((events, feed, ticks))));
                        }
                    }
                    burst = events.next() => match burst {
                        Some(burst) => burst.iter().for_each(|e| feed.take(e)),
                        // The engine stopped: the last line says so.
                        None => return feed.flush(every, true).map(|line| (Ok(line), None)),
                    },
                }
            }
        },
    );
    Ok((
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        axum::body::Body::from_stream(stream),
    )
        .into_response())
}

#[derive(Deserialize, Default)]
struct ActionForm {
    recursive: Option<bool>,
}

/// An operator's action on a procedure: bearer token, CSRF token (from a browser),
/// then the engine.
async fn action<E: Send + Sync + 'static>(
    State(admin): Shared<E>,
    Path((id, action)): Path<(String, String)>,
    Query(form): Query<ActionForm>,
    request: Request,
) -> Result<Response, Refusal> {
    let headers = request.headers();
    let extensions = request.extensions();
    let who = extensions
        .get::<ConnectInfo<guard::Served>>()
        .map(|c| c.0.peer)
        .or_else(|| extensions.get::<ConnectInfo<SocketAddr>>().map(|c| c.0))
        .map_or_else(|| "unknown peer".to_string(), |peer| peer.to_string());
    let Some(expected) = &admin.token else {
        return Err(Refusal(
            StatusCode::FORBIDDEN,
            "the admin page is read-only: the service set no token".into(),
        ));
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|h| h.to_str().ok())
        .and_then(|h| h.strip_prefix("Bearer "));
    match given {
        None => {
            return Err(Refusal(
                StatusCode::UNAUTHORIZED,
                "actions need `Authorization: Bearer <token>`".into(),
            ))
        }
        Some(token) if !same(token, expected) => {
            tracing::warn!(target: crate::targets::ADMIN, who = %who, action, id, "admin action with a wrong token refused");
            return Err(Refusal(StatusCode::FORBIDDEN, "wrong token".into()));
        }
        Some(_) => {}
    }
    let csrf = headers.get("x-csrf-token").and_then(|h| h.to_str().ok());
    if from_a_browser(headers) && !csrf.is_some_and(|c| same(c, &admin.csrf)) {
        return Err(Refusal(
            StatusCode::FORBIDDEN,
            "missing or stale CSRF token (x-csrf-token): reload the page".into(),
        ));
    }
    let id = parse_id(&id)?;
    tracing::info!(target: crate::targets::ADMIN, who = %who, action, %id, "admin action");
    let executor = &admin.executor;
    let done = match action.as_str() {
        "abort" => executor
            .abort(id)
            .await
            .map(|accepted| json!({ "accepted": accepted })),
        "pause" => executor.pause(id).await.map(|()| json!({ "paused": true })),
        "resume" | "continue" => executor
            .resume(id)
            .await
            .map(|()| json!({ "continued": true })),
        "rollback" => executor
            .rollback(id)
            .await
            .map(|()| json!({ "rolling_back": true })),
        "bypass" => executor
            .bypass(id, form.recursive.unwrap_or(false))
            .await
            .map(|()| json!({ "bypassed": true })),
        "force-bypass" => executor
            .force_bypass(id, form.recursive.unwrap_or(false))
            .await
            .map(|()| json!({ "bypassed": true })),
        other => {
            return Err(bad_request(format!(
                "unknown action {other:?}: abort, pause, resume (or continue), rollback, \
                 bypass or force-bypass"
            )))
        }
    };
    done.map(|body| Json(body).into_response())
        .map_err(|e| engine_error(&e))
}

/// Whether a request shows it comes from a browser: it names its `Origin` (browsers
/// send one with every POST), its `Sec-Fetch-Site`, or carries cookies. Such a request
/// needs the page's CSRF token besides the bearer token: what a browser attaches by
/// itself (cookies, and a bearer token a proxy in front adds from them) must not let
/// another page act through the operator's browser. A client that is no browser (a
/// script, `curl`, another service) authenticates with the bearer token alone, which
/// no page of another origin can make a browser send.
fn from_a_browser(headers: &HeaderMap) -> bool {
    headers.contains_key(header::ORIGIN)
        || headers.contains_key("sec-fetch-site")
        || headers.contains_key(header::COOKIE)
}

/// Compares tokens without stopping at the first difference.
fn same(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}
