//! The admin page over HTTP: every page and its JSON, filters and paging, bad input
//! answered 400 with a message, actions refused without a token (401), with a wrong
//! one (403) or, from a browser, without the CSRF token (403), a client that is no
//! browser acting with the bearer token alone, an abort through the endpoint rolling a
//! tree back, a tree's execution stack and rollback order, a DAG's tasks and edges, the
//! lock queues, the engine's store, group commit and failures, why a procedure waits
//! for an operator, and the live feed. Nested under a prefix, the prefix leads to the
//! procedures page and every link of the pages stays under it.
//! Only a request naming the page's own address or a configured host name is
//! answered (421 otherwise, as a DNS-rebinding page would be), an action from another
//! origin is refused (403), and every answer carries the security headers.
//! Configured with a cluster's store, the engine page and its JSON show the cluster
//! (members, partitions with their owners and epochs, moves) beside the engine's role
//! as a partition's owner; a schema without a cluster shows none, a store that cannot
//! be read an error, and the rest of the page is still answered.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{Recorder, Scripted, Step};
use proctor::admin::AdminConfig;
use proctor::{
    async_trait, Context, Executor, Flow, Lock, ProcError, ProcId, ProcState, Procedure, Registry,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;

const TOKEN: &str = "the-operators-token";

struct Page {
    base: String,
    http: reqwest::Client,
    executor: Executor<Recorder>,
}

impl Page {
    async fn get(&self, path: &str) -> (u16, String) {
        let answer = self
            .http
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .unwrap();
        (answer.status().as_u16(), answer.text().await.unwrap())
    }

    async fn json(&self, path: &str) -> (u16, Value) {
        let answer = self
            .http
            .get(format!("{}{path}", self.base))
            .header("accept", "application/json")
            .send()
            .await
            .unwrap();
        (answer.status().as_u16(), answer.json().await.unwrap())
    }

    async fn post(&self, path: &str, token: Option<&str>, csrf: Option<&str>) -> (u16, Value) {
        self.post_with(path, token, csrf, &[]).await
    }

    /// As [`post`](Self::post), with these headers too.
    async fn post_with(
        &self,
        path: &str,
        token: Option<&str>,
        csrf: Option<&str>,
        headers: &[(&str, String)],
    ) -> (u16, Value) {
        let mut request = self.http.post(format!("{}{path}", self.base));
        for (name, value) in headers {
            request = request.header(*name, value);
        }
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        if let Some(csrf) = csrf {
            request = request.header("x-csrf-token", csrf);
        }
        let answer = request.send().await.unwrap();
        (answer.status().as_u16(), answer.json().await.unwrap())
    }

    /// The answer to a GET of `path` with the `Host` header `host`.
    async fn get_with_host(&self, path: &str, host: &str, accept: &str) -> reqwest::Response {
        self.http
            .get(format!("{}{path}", self.base))
            .header("host", host)
            .header("accept", accept)
            .send()
            .await
            .unwrap()
    }

    /// `host:port` of the page's own address.
    fn authority(&self) -> &str {
        self.base
            .trim_start_matches("http://")
            .trim_end_matches('/')
    }

    fn port(&self) -> u16 {
        self.authority()
            .rsplit(':')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    }

    /// The JSON of `path` once `ready` holds for it, asked again until then (for at
    /// most 20 s).
    async fn json_when(&self, path: &str, ready: impl Fn(&Value) -> bool) -> Value {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let (_, json) = self.json(path).await;
            if ready(&json) {
                return json;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "never ready: {path}: {json}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// The CSRF token the pages carry.
    async fn csrf(&self) -> String {
        let (_, html) = self.get("procedures").await;
        let needle = "name=\"csrf-token\" content=\"";
        let at = html.find(needle).unwrap() + needle.len();
        html[at..at + 32].to_string()
    }
}

/// An executor of the common procedures on a memory store.
async fn executor() -> Executor<Recorder> {
    Executor::builder()
        .registry(common::registry())
        .store(proctor::MemoryStore::new())
        .env(Arc::new(Recorder::default()))
        .start()
        .await
        .unwrap()
}

async fn page(config: AdminConfig) -> Page {
    serve(executor().await, config).await
}

async fn serve(executor: Executor<Recorder>, config: AdminConfig) -> Page {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}/", listener.local_addr().unwrap());
    actix::spawn(config.serve_on(listener, executor.clone()));
    Page {
        base,
        http: reqwest::Client::new(),
        executor,
    }
}

/// One finished root, and one waiting for its child, which waits for the event `go`.
async fn two_trees(executor: &Executor<Recorder>) -> (ProcId, ProcId) {
    let done = executor
        .submit(Scripted::new("done", vec![Step::More]))
        .await
        .unwrap();
    executor.wait(done).await.unwrap().unwrap();
    let child = Scripted::new("child", vec![Step::Suspend("go".into()), Step::More]);
    let steps = vec![Step::Children(vec![child]), Step::More];
    let waiting = executor
        .submit(Scripted::new("waiting", steps))
        .await
        .unwrap();
    common::waiting_children(executor, waiting, 1).await;
    common::wait_for_state(executor, waiting, ProcState::Waiting).await;
    (done, waiting)
}

#[actix::test]
async fn pages_and_their_json_filter_and_page() {
    let page = page(AdminConfig::default()).await;
    let (done, waiting) = two_trees(&page.executor).await;

    let (status, html) = page.get("procedures").await;
    assert_eq!(status, 200);
    assert!(
        html.contains("<title>proctor · Procedures</title>"),
        "{html}"
    );
    assert!(
        html.contains(&format!("data-id=\"{}\"", waiting.0)),
        "{html}"
    );
    assert!(html.contains("event go"), "what it waits for: {html}");

    let (_, all) = page.json("procedures").await;
    assert_eq!(all["total"], 3, "{all}");
    let (_, waits) = page.json("procedures?state=WAITING").await;
    assert_eq!(waits["total"], 2, "{waits}");
    // Newest first: the child, then its parent.
    assert_eq!(waits["procedures"][0]["parent"], waiting.0);
    assert_eq!(waits["procedures"][0]["waiting_for"]["event"], "go");
    assert_eq!(waits["procedures"][1]["waiting_for"], "children");
    // Each ran one step (recorded, not rolled back); a finished one keeps none.
    assert_eq!(waits["procedures"][0]["steps"], 1, "{waits}");
    assert_eq!(waits["procedures"][1]["steps"], 1, "{waits}");
    let finished = all["procedures"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["id"] == done.0)
        .unwrap();
    assert!(finished["steps"].is_null(), "{finished}");
    let (_, typed) = page.json("procedures?state=&type=scripted").await;
    assert_eq!(typed["total"], 3, "{typed}");
    let (_, tree) = page.json(&format!("procedures?tree={}", waiting.0)).await;
    assert_eq!(tree["total"], 2, "the root and its child: {tree}");
    let (_, second) = page.json("procedures?per_page=1&page=2").await;
    assert_eq!(second["procedures"].as_array().unwrap().len(), 1);
    assert_eq!(second["total"], 3);

    for (query, says) in [
        ("procedures?state=NOPE", "unknown state \"NOPE\""),
        ("procedures?page=0", "page must be a number from 1"),
        ("procedures?per_page=abc", "per_page must be a number"),
        ("procedures?tree=x", "tree must be a number"),
        ("procedures/abc", "not a procedure id"),
    ] {
        let (status, body) = page.json(query).await;
        assert_eq!(status, 400, "{query}: {body}");
        assert!(
            body["error"].as_str().unwrap().contains(says),
            "{query}: {body}"
        );
    }
    let (status, _) = page.json("procedures/987654321").await;
    assert_eq!(status, 404);

    let (status, html) = page.get(&format!("procedures/{}", waiting.0)).await;
    assert_eq!(status, 200);
    assert!(html.contains("class=\"tree\""), "{html}");
    let (_, tree) = page.json(&format!("procedures/{}", done.0)).await;
    assert_eq!(tree["root"], done.0);

    let (status, engine) = page.json("engine").await;
    assert_eq!(status, 200);
    assert_eq!(engine["leadership"]["role"], "alone");
    assert!(engine["workers"].as_u64().unwrap() > 0);
    assert!(
        engine.get("cluster").is_none(),
        "no cluster configured: {engine}"
    );
    let (status, locks) = page.json("locks").await;
    assert_eq!(status, 200);
    assert!(locks["resources"].as_array().unwrap().is_empty());
    assert!(locks["cycles"].as_array().unwrap().is_empty());
    for asset in ["assets/admin.css", "assets/admin.js", "locks", "engine"] {
        assert_eq!(page.get(asset).await.0, 200, "{asset}");
    }
    page.executor.clone().shutdown().await.unwrap();
}

#[actix::test]
async fn actions_need_the_token_and_the_csrf_token_and_an_abort_rolls_the_tree_back() {
    let read_only = page(AdminConfig::default()).await;
    let (_, waiting) = two_trees(&read_only.executor).await;
    let csrf = read_only.csrf().await;
    let (status, body) = read_only
        .post(
            &format!("procedures/{}/abort", waiting.0),
            Some(TOKEN),
            Some(&csrf),
        )
        .await;
    assert_eq!(status, 403, "{body}");
    assert!(body["error"].as_str().unwrap().contains("read-only"));
    read_only.executor.clone().shutdown().await.unwrap();

    let page = page(AdminConfig::default().token(TOKEN)).await;
    let (_, waiting) = two_trees(&page.executor).await;
    let csrf = page.csrf().await;
    let abort = format!("procedures/{}/abort", waiting.0);
    assert_eq!(page.post(&abort, None, Some(&csrf)).await.0, 401);
    assert_eq!(page.post(&abort, Some("guess"), Some(&csrf)).await.0, 403);
    // A browser's request (it names its origin) needs the page's CSRF token too.
    let browser = [("origin", format!("http://{}", page.authority()))];
    let (status, body) = page.post_with(&abort, Some(TOKEN), None, &browser).await;
    assert_eq!(status, 403);
    assert!(body["error"].as_str().unwrap().contains("CSRF"), "{body}");
    let (status, body) = page
        .post_with(&abort, Some(TOKEN), Some("0000"), &browser)
        .await;
    assert_eq!(status, 403, "{body}");
    let (status, body) = page
        .post(
            &format!("procedures/{}/explode", waiting.0),
            Some(TOKEN),
            Some(&csrf),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    // A query string carries no action: a GET of the action's path is not one.
    assert_eq!(page.get(&format!("{abort}?token={TOKEN}")).await.0, 405);
    assert_eq!(
        page.executor.state(waiting).await.unwrap().state,
        ProcState::Waiting
    );

    let (status, body) = page
        .post_with(&abort, Some(TOKEN), Some(&csrf), &browser)
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["accepted"], true);
    let failure = page.executor.wait(waiting).await.unwrap().unwrap_err();
    assert!(failure.to_string().contains("abort"), "{failure}");
    // The engine's refusal, as it says it: the tree is finished.
    let (status, body) = page
        .post(
            &format!("procedures/{}/pause", waiting.0),
            Some(TOKEN),
            Some(&csrf),
        )
        .await;
    assert_eq!(status, 409, "{body}");
    assert!(!body["error"].as_str().unwrap().is_empty());
    page.executor.clone().shutdown().await.unwrap();
}

/// A client that is no browser (a script, `curl`, another service) authenticates with
/// the bearer token alone: the page's CSRF token is in its HTML only, and what it
/// guards against — a foreign page making the operator's browser act with what the
/// browser attaches by itself — cannot send an `Authorization` header. A request that
/// shows it comes from a browser (its `Origin`, its `Sec-Fetch-Site`, or cookies it
/// carries, which a proxy in front may log operators in with) needs the CSRF token.
#[actix::test]
async fn a_client_with_the_bearer_token_needs_no_csrf_token_a_browser_does() {
    let page = page(AdminConfig::default().token(TOKEN)).await;
    let (_, root) = two_trees(&page.executor).await;
    // The child, waiting for an event: a pause takes effect at once.
    let waiting = common::waiting_children(&page.executor, root, 1).await[0];
    let csrf = page.csrf().await;
    let pause = format!("procedures/{}/pause", waiting.0);
    let own = format!("http://{}", page.authority());
    for browser in [
        vec![("origin", own.clone())],
        vec![("sec-fetch-site", "same-origin".to_string())],
        vec![("cookie", "session=operator".to_string())],
    ] {
        let (status, body) = page.post_with(&pause, Some(TOKEN), None, &browser).await;
        assert_eq!(status, 403, "{browser:?}: {body}");
        assert!(body["error"].as_str().unwrap().contains("CSRF"), "{body}");
        let (status, body) = page
            .post_with(&pause, Some(TOKEN), Some("stale"), &browser)
            .await;
        assert_eq!(status, 403, "{browser:?}: {body}");
    }
    // Without the bearer token, no CSRF token helps.
    assert_eq!(page.post(&pause, None, Some(&csrf)).await.0, 401);
    assert_eq!(
        page.executor.state(waiting).await.unwrap().state,
        ProcState::Waiting
    );
    // The JSON client: the bearer token, nothing else.
    let (status, body) = page.post(&pause, Some(TOKEN), None).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["paused"], true, "{body}");
    let continued = format!("procedures/{}/continue", waiting.0);
    let browser = [("origin", own)];
    let (status, body) = page
        .post_with(&continued, Some(TOKEN), Some(&csrf), &browser)
        .await;
    assert_eq!(status, 200, "{body}");
    page.executor.clone().shutdown().await.unwrap();
}

/// Nested under a prefix in a service's own router (`nest_service`), the page lives
/// there: the prefix, with or without its slash, leads to the procedures page, and
/// every link, form, stylesheet and script of the pages resolves under the prefix.
/// Nested with `nest`, the prefix without its slash does too (axum's `nest` routes
/// nothing at the prefix with a slash). Alone, `/` leads to the procedures page.
#[actix::test]
async fn a_router_nested_under_a_prefix_serves_its_pages_and_links_there() {
    let executor = executor().await;
    let (_, waiting) = two_trees(&executor).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let own = listener.local_addr().unwrap().to_string();
    let config = AdminConfig::default().allow_host(own.clone()).token(TOKEN);
    let app = axum::Router::new()
        .nest_service(
            "/ops/admin",
            proctor::admin::router(executor.clone(), config.clone()),
        )
        .nest("/flat", proctor::admin::router(executor.clone(), config));
    actix::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let http = reqwest::Client::new();
    let get = |url: reqwest::Url| {
        let request = http.get(url);
        async move {
            let answer = request.send().await.unwrap();
            let (status, url) = (answer.status().as_u16(), answer.url().clone());
            (status, url, answer.text().await.unwrap())
        }
    };
    let root: reqwest::Url = format!("http://{own}/").parse().unwrap();
    for prefix in ["ops/admin", "ops/admin/"] {
        let (status, url, html) = get(root.join(prefix).unwrap()).await;
        assert_eq!(status, 200, "{prefix}: {url}: {html}");
        assert_eq!(url.path(), "/ops/admin/procedures", "{prefix}");
        assert!(
            html.contains("<title>proctor · Procedures</title>"),
            "{html}"
        );
    }
    let (status, url, _) = get(root.join("flat").unwrap()).await;
    assert_eq!((status, url.path()), (200, "/flat/procedures"));
    // The guard comes first: a foreign Host gets no redirect.
    let answer = http
        .get(root.join("ops/admin/").unwrap())
        .header("host", "evil.example")
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 421);
    // Every link of the procedures page and of a tree's page, resolved as a browser
    // does, is answered; the live feed's and the actions' paths too.
    let procedures = root.join("ops/admin/procedures").unwrap();
    let tree = root
        .join(&format!("ops/admin/procedures/{}", waiting.0))
        .unwrap();
    for page in [procedures.clone(), tree] {
        let (status, _, html) = get(page.clone()).await;
        assert_eq!(status, 200, "{page}");
        let links = links(&html);
        assert!(links.len() >= 6, "{page}: {links:?}");
        for link in links {
            let url = page.join(&link).unwrap();
            assert!(
                url.path().starts_with("/ops/admin/"),
                "{page}: {link} is {url}"
            );
            let (status, _, body) = get(url.clone()).await;
            assert_eq!(status, 200, "{page}: {link} is {url}: {body}");
        }
        let base = base_of(&html);
        let events = page.join(&format!("{base}events")).unwrap();
        assert_eq!(events.path(), "/ops/admin/events", "{page}");
        let abort = page
            .join(&format!("{base}procedures/{}/explode", waiting.0))
            .unwrap();
        let answer = http.post(abort).bearer_auth(TOKEN).send().await.unwrap();
        assert_eq!(
            answer.status(),
            400,
            "an unknown action, answered by its handler"
        );
    }
    // The filter form posts to the page itself, a page of the list to itself too.
    let (_, _, html) = get(procedures).await;
    assert!(
        html.contains(r#"<form class="filters" method="get">"#),
        "{html}"
    );
    executor.shutdown().await.unwrap();

    let page = page(AdminConfig::default()).await;
    let (status, url, _) = get(page.base.parse().unwrap()).await;
    assert_eq!((status, url.path()), (200, "/procedures"));
    page.executor.clone().shutdown().await.unwrap();
}

/// The `href` and `src` values of `html`, but the page's own query links (`?...`).
fn links(html: &str) -> Vec<String> {
    let mut links = Vec::new();
    for attribute in ["href=\"", "src=\""] {
        let mut rest = html;
        while let Some(at) = rest.find(attribute) {
            rest = &rest[at + attribute.len()..];
            let end = rest.find('"').unwrap();
            if !rest[..end].starts_with('?') {
                links.push(rest[..end].replace("&amp;", "&"));
            }
            rest = &rest[end..];
        }
    }
    links
}

/// The page's way back to the admin root (its `data-base`), which its script's
/// requests start from.
fn base_of(html: &str) -> String {
    let needle = "data-base=\"";
    let at = html.find(needle).unwrap() + needle.len();
    let end = html[at..].find('"').unwrap();
    html[at..at + end].to_string()
}

/// The routes a foreign page would read: HTML, JSON, the live feed, the assets.
const READS: [(&str, &str); 8] = [
    ("procedures", "text/html"),
    ("procedures", "application/json"),
    ("procedures/1", "application/json"),
    ("locks", "application/json"),
    ("engine", "text/html"),
    ("events?new=true", "text/event-stream"),
    ("assets/admin.js", "*/*"),
    ("", "text/html"),
];

#[actix::test]
async fn a_foreign_host_is_refused_on_pages_json_and_the_live_feed() {
    let page = page(AdminConfig::default().token(TOKEN)).await;
    let (_, waiting) = two_trees(&page.executor).await;
    let foreign = format!("evil.example:{}", page.port());
    for host in [
        foreign.as_str(),
        "evil.example",
        // The page's port under another name or address.
        &format!("127.0.0.2:{}", page.port()),
        &format!("localhost.evil.example:{}", page.port()),
        // Its address on another port.
        "127.0.0.1:1",
        "localhost:1",
        "user@127.0.0.1",
        "",
    ] {
        for (path, accept) in READS {
            let answer = page.get_with_host(path, host, accept).await;
            assert_eq!(answer.status(), 421, "{host:?} {path} {accept}");
            assert_eq!(
                answer.headers()["content-type"],
                "text/plain; charset=utf-8"
            );
            let body = answer.text().await.unwrap();
            assert!(body.contains("Host"), "{host:?} {path}: {body}");
            // Nothing of the engine's.
            assert!(
                !body.contains("scripted") && !body.contains("WAITING"),
                "{body}"
            );
        }
    }
    // No Host at all (HTTP/1.0 needs none).
    let mut raw = tokio::net::TcpStream::connect(page.authority())
        .await
        .unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut raw, b"GET /procedures HTTP/1.0\r\n\r\n")
        .await
        .unwrap();
    let mut answer = String::new();
    tokio::io::AsyncReadExt::read_to_string(&mut raw, &mut answer)
        .await
        .unwrap();
    assert!(answer.starts_with("HTTP/1.0 421"), "{answer}");
    assert!(answer.contains("no Host"), "{answer}");
    // An action under a foreign Host is refused before its tokens are looked at.
    let csrf = page.csrf().await;
    let answer = page
        .http
        .post(format!("{}procedures/{}/abort", page.base, waiting.0))
        .header("host", &foreign)
        .bearer_auth(TOKEN)
        .header("x-csrf-token", &csrf)
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 421);
    assert_eq!(
        page.executor.state(waiting).await.unwrap().state,
        ProcState::Waiting
    );
    page.executor.clone().shutdown().await.unwrap();
}

#[actix::test]
async fn the_bound_address_localhost_and_configured_hosts_are_answered() {
    let page = page(
        AdminConfig::default()
            .allow_host("Ops.Example.com")
            .allow_host("proxy.example:8443")
            .allow_host("10.1.2.3"),
    )
    .await;
    let port = page.port();
    let own = page.authority().to_string();
    for host in [
        own.as_str(),
        &format!("localhost:{port}"),
        &format!("LocalHost:{port}"),
        // A name without a port is allowed on any port, and without one.
        "ops.example.com",
        "ops.example.com:443",
        &format!("OPS.EXAMPLE.COM:{port}"),
        "proxy.example:8443",
        "10.1.2.3:8080",
    ] {
        for (path, accept) in READS {
            let answer = page.get_with_host(path, host, accept).await;
            let status = answer.status().as_u16();
            // `procedures/1` is no procedure here.
            let expected = if path == "procedures/1" { 404 } else { 200 };
            assert_eq!(status, expected, "{host} {path}");
        }
    }
    for host in [
        // A name with a port is allowed on that port only.
        "proxy.example",
        "proxy.example:8444",
        "sub.ops.example.com",
        "ops.example.com.evil.example",
        "10.1.2.4",
    ] {
        let answer = page.get_with_host("procedures", host, "text/html").await;
        assert_eq!(answer.status(), 421, "{host}");
    }
    page.executor.clone().shutdown().await.unwrap();
}

#[actix::test]
async fn a_nested_router_answers_only_the_hosts_it_is_configured_with() {
    let executor = executor().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let own = listener.local_addr().unwrap().to_string();
    let nested = |config: AdminConfig| {
        axum::Router::new().nest("/admin", proctor::admin::router(executor.clone(), config))
    };
    let app = axum::Router::new()
        .merge(nested(AdminConfig::default().allow_host(own.clone())))
        .nest("/bare", nested(AdminConfig::default()));
    actix::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let http = reqwest::Client::new();
    let get = |path: String, host: &'static str| {
        let mut request = http.get(format!("http://{own}/{path}"));
        if !host.is_empty() {
            request = request.header("host", host);
        }
        async move { request.send().await.unwrap() }
    };
    // The service named its address: that Host is answered, another is not.
    assert_eq!(get("admin/procedures".into(), "").await.status(), 200);
    assert_eq!(get("admin/engine".into(), "").await.status(), 200);
    assert_eq!(
        get("admin/procedures".into(), "evil.example")
            .await
            .status(),
        421
    );
    // It named none: nothing is answered, and the refusal says what to configure.
    let answer = get("bare/admin/procedures".into(), "").await;
    assert_eq!(answer.status(), 421);
    let body = answer.text().await.unwrap();
    assert!(body.contains("allow_host"), "{body}");
    executor.shutdown().await.unwrap();
}

#[actix::test]
async fn an_action_from_another_origin_is_refused() {
    let page = page(
        AdminConfig::default()
            .token(TOKEN)
            .allow_host("ops.example"),
    )
    .await;
    let (_, waiting) = two_trees(&page.executor).await;
    let csrf = page.csrf().await;
    let post = |origin: Option<String>, action: &str| {
        let mut request = page
            .http
            .post(format!("{}procedures/{}/{action}", page.base, waiting.0))
            .bearer_auth(TOKEN)
            .header("x-csrf-token", &csrf);
        if let Some(origin) = origin {
            request = request.header("origin", origin);
        }
        async move {
            let answer = request.send().await.unwrap();
            let status = answer.status().as_u16();
            (status, answer.json::<Value>().await.unwrap())
        }
    };
    let port = page.port();
    for origin in [
        "http://evil.example".to_string(),
        format!("http://evil.example:{port}"),
        format!("http://127.0.0.1:{}", port.wrapping_add(1)),
        // The port a scheme implies is the one compared.
        "http://127.0.0.1".to_string(),
        "null".to_string(),
        "not an origin".to_string(),
        format!("http://127.0.0.1:{port}/path"),
    ] {
        let (status, body) = post(Some(origin.clone()), "pause").await;
        assert_eq!(status, 403, "{origin}: {body}");
        assert!(
            body["error"].as_str().unwrap().contains("Origin"),
            "{origin}: {body}"
        );
    }
    assert_eq!(
        page.executor.state(waiting).await.unwrap().state,
        ProcState::Waiting
    );
    // The page's own origin, a configured one, and none (a client that is no browser)
    // pass: an unknown action is then the handler's 400.
    for origin in [
        Some(format!("http://127.0.0.1:{port}")),
        Some(format!("http://localhost:{port}")),
        Some("https://ops.example".into()),
        None,
    ] {
        let (status, body) = post(origin.clone(), "explode").await;
        assert_eq!(status, 400, "{origin:?}: {body}");
    }
    let (status, body) = post(Some(format!("http://127.0.0.1:{port}")), "abort").await;
    assert_eq!(status, 200, "{body}");
    assert!(page.executor.wait(waiting).await.unwrap().is_err());
    page.executor.clone().shutdown().await.unwrap();
}

#[actix::test]
async fn every_answer_carries_the_security_headers() {
    let page = page(AdminConfig::default()).await;
    let own = page.authority().to_string();
    for (path, accept, host, status) in [
        ("procedures", "text/html", own.as_str(), 200),
        ("engine", "application/json", &own, 200),
        ("assets/admin.css", "*/*", &own, 200),
        ("procedures?page=0", "application/json", &own, 400),
        ("no-such-page", "text/html", &own, 404),
        ("procedures", "text/html", "evil.example", 421),
    ] {
        let answer = page.get_with_host(path, host, accept).await;
        assert_eq!(answer.status(), status, "{path} {host}");
        let headers = answer.headers();
        assert_eq!(headers["x-frame-options"], "DENY", "{path}");
        assert_eq!(headers["x-content-type-options"], "nosniff", "{path}");
        assert_eq!(headers["referrer-policy"], "no-referrer", "{path}");
        let csp = headers["content-security-policy"].to_str().unwrap();
        for part in ["default-src 'self'", "frame-ancestors 'none'"] {
            assert!(csp.contains(part), "{path}: {csp}");
        }
        assert!(!csp.contains("unsafe-inline"), "{csp}");
    }
    // The pages hold no inline script, style or event handler for the policy to block.
    let (_, html) = page.get("procedures").await;
    assert!(
        !html.contains("<script>") && !html.contains("<style"),
        "{html}"
    );
    assert!(
        !html.contains(" style=") && !html.contains(" onclick="),
        "{html}"
    );
    page.executor.clone().shutdown().await.unwrap();
}

/// Reads the stream's `data:` lines until one satisfies `done`; answers them all.
async fn lines_until(
    stream: &mut reqwest::Response,
    mut done: impl FnMut(&serde_json::Value) -> bool,
) -> Vec<serde_json::Value> {
    let mut text = String::new();
    let mut lines = Vec::new();
    loop {
        let chunk = stream.chunk().await.unwrap().expect("the stream goes on");
        text.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = text.find("\n\n") {
            let event: String = text.drain(..end + 2).collect();
            if let Some(data) = event.trim().strip_prefix("data: ") {
                let line: serde_json::Value = serde_json::from_str(data).unwrap();
                let stop = done(&line);
                lines.push(line);
                if stop {
                    return lines;
                }
            }
        }
    }
}

#[actix::test]
async fn the_live_feed_folds_events_into_ticks_with_new_and_watched_rows() {
    let page = page(AdminConfig::default().live_every(Duration::from_millis(20))).await;
    let waiting = page
        .executor
        .submit(Scripted::new("watched", vec![Step::Suspend("go".into())]))
        .await
        .unwrap();
    common::wait_for_state(&page.executor, waiting, ProcState::Waiting).await;
    let mut stream = page
        .http
        .get(format!("{}events?new=true&watch={}", page.base, waiting.0))
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    assert_eq!(stream.headers()["content-type"], "text/event-stream");
    // The first tick greets.
    let first = lines_until(&mut stream, |_| true).await;
    assert_eq!(first[0]["event"], "tick");

    let id = page
        .executor
        .submit(Scripted::new("seen", vec![Step::More]))
        .await
        .unwrap();
    let lines = lines_until(&mut stream, |l| {
        l["new"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n["id"] == id.0 && n["state"] == "SUCCESS")
            || l["changed"]
                .as_array()
                .unwrap()
                .iter()
                .any(|c| c["id"] == id.0)
    })
    .await;
    let submitted: u64 = lines.iter().map(|l| l["submitted"].as_u64().unwrap()).sum();
    let succeeded: u64 = lines.iter().map(|l| l["succeeded"].as_u64().unwrap()).sum();
    assert_eq!((submitted, succeeded), (1, 1), "{lines:?}");
    assert!(
        lines.iter().any(|l| l["new"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n["id"] == id.0 && n["type"] == "scripted")),
        "{lines:?}"
    );

    // A watched row that finishes comes back with its state.
    page.executor.abort(waiting).await.unwrap();
    let lines = lines_until(&mut stream, |l| {
        !l["changed"].as_array().unwrap().is_empty()
    })
    .await;
    let last = lines.last().unwrap();
    assert_eq!(
        last["changed"],
        serde_json::json!([{ "id": waiting.0, "state": "ROLLEDBACK" }])
    );

    // Bad interest is a 400 that says why.
    for bad in ["watch=1,x", "watch=-3", "new=maybe"] {
        let answer = page
            .http
            .get(format!("{}events?{bad}", page.base))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), 400, "{bad}");
    }
    page.executor.clone().shutdown().await.unwrap();
}

/// Takes its lock for life and waits for the event `release`.
#[derive(Serialize, Deserialize)]
struct Hold {
    resource: String,
    step: u32,
}

#[async_trait]
impl Procedure<Recorder> for Hold {
    async fn execute(&mut self, _ctx: &mut Context<Recorder>) -> Result<Flow<Recorder>, ProcError> {
        self.step += 1;
        Ok(if self.step == 1 {
            Flow::Suspend("release".into())
        } else {
            Flow::Done
        })
    }

    async fn rollback(&mut self, _ctx: &mut Context<Recorder>) -> Result<(), ProcError> {
        Ok(())
    }

    fn locks(&self) -> Vec<Lock> {
        vec![Lock::exclusive(self.resource.clone())]
    }

    fn holds_lock(&self) -> bool {
        true
    }
}

/// Fails its one step; its rollback panics every time.
#[derive(Serialize, Deserialize)]
struct Unrollable;

#[async_trait]
impl Procedure<Recorder> for Unrollable {
    async fn execute(&mut self, _ctx: &mut Context<Recorder>) -> Result<Flow<Recorder>, ProcError> {
        Err(ProcError::failed("the step fails"))
    }

    async fn rollback(&mut self, _ctx: &mut Context<Recorder>) -> Result<(), ProcError> {
        panic!("cannot undo");
    }
}

/// A page of its own executor: the common procedures, `Hold` and `Unrollable`, a
/// resource `pool` of two permits, and a failed rollback retried once.
async fn own_page() -> (Page, Arc<Recorder>) {
    let mut registry: Registry<Recorder> = common::registry();
    registry
        .register::<Hold>("hold")
        .register::<Unrollable>("unrollable");
    let rec = Arc::new(Recorder::default());
    let executor = Executor::builder()
        .registry(registry)
        .store(proctor::MemoryStore::new())
        .env(rec.clone())
        .permits("pool", 2)
        .rollback_retries(1)
        .start()
        .await
        .unwrap();
    (serve(executor, AdminConfig::default()).await, rec)
}

/// A rollback that keeps failing pauses its procedure, and its row says why: the
/// error, its policy and the retries spent, as `proctor procs` says it.
#[actix::test]
async fn a_rollback_paused_procedure_shows_why_it_waits_for_an_operator() {
    let (page, _rec) = own_page().await;
    let mut events = page.executor.subscribe().await.unwrap();
    let id = page.executor.submit(Unrollable).await.unwrap();
    loop {
        match events.next().await.expect("an event") {
            proctor::ProcEvent::Paused { id: p, state, .. } if p == id => {
                assert_eq!(state, ProcState::RollbackPaused);
                break;
            }
            proctor::ProcEvent::Finished { result, .. } => panic!("finished: {result:?}"),
            _ => {}
        }
    }
    let (status, html) = page.get("procedures?state=ROLLBACK_PAUSED").await;
    assert_eq!(status, 200);
    assert!(html.contains(&format!("data-id=\"{}\"", id.0)), "{html}");
    let why = "an operator: panicked in rollback: cannot undo (policy Rollback, 1 retries)";
    assert!(html.contains(why), "{html}");
    let (_, json) = page.json("procedures?state=ROLLBACK_PAUSED").await;
    let paused = &json["procedures"][0]["steering"]["paused"];
    assert_eq!(paused["retries"], 1, "{json}");
    assert!(
        paused["error"].to_string().contains("cannot undo"),
        "{json}"
    );
    page.executor.clone().shutdown().await.unwrap();
}

#[actix::test]
async fn a_tree_shows_its_execution_stack_and_its_rollback_so_far_in_order() {
    let (page, rec) = own_page().await;
    let root = page.executor.submit(common::Unwind::root()).await.unwrap();
    // The root's second rollback step holds: the child's two steps and the root's
    // last are undone.
    rec.signal.notified().await;
    let (status, tree) = page.json(&format!("procedures/{}", root.0)).await;
    assert_eq!(status, 200, "{tree}");
    let execution = &tree["execution"];
    assert_eq!(execution["rolling_back"], true, "{tree}");
    let executed = common::recorded(&rec, "exec ");
    let undone = common::recorded(&rec, "rollback ");
    let ids = |v: &Value| -> Vec<u64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|i| i.as_u64().unwrap())
            .collect()
    };
    // The stack holds what is left to undo, oldest first: the root's first step.
    assert_eq!(ids(&execution["stack"]), [root.0], "{tree}");
    // The steps undone so far, in the order their rollbacks ran (the held one is
    // still on the stack), newest step first: the child's two, the root's second.
    let child = executed[2];
    assert_eq!(executed, [root.0, root.0, child, child]);
    assert_eq!(undone, [child, child, root.0, root.0][..undone.len()]);
    assert_eq!(
        ids(&execution["rolled_back"]),
        [child, child, root.0],
        "{tree}"
    );
    let (_, html) = page.get(&format!("procedures/{}", root.0)).await;
    assert!(html.contains("Rollback so far"), "{html}");
    assert!(
        html.contains(&format!(
            r#"<span id="rolled-back"><a href="{child}">{child}</a> <a href="{child}">{child}</a> <a href="{r}">{r}</a></span>"#,
            r = root.0
        )),
        "{html}"
    );

    rec.gate.notify_one();
    assert!(page.executor.wait(root).await.unwrap().is_err());
    // Finished: no stack left, the procedures still listed.
    let (_, tree) = page.json(&format!("procedures/{}", root.0)).await;
    assert!(tree["execution"].is_null(), "{tree}");
    assert_eq!(tree["procedures"][0]["id"], root.0, "{tree}");
    page.executor.clone().shutdown().await.unwrap();
}

#[actix::test]
async fn locks_show_holders_the_queue_in_order_and_counted_resources() {
    let (page, _rec) = own_page().await;
    let hold = |resource: &str| Hold {
        resource: resource.into(),
        step: 0,
    };
    let first = page.executor.submit(hold("db/t1")).await.unwrap();
    common::wait_for_state(&page.executor, first, ProcState::Waiting).await;
    let second = page.executor.submit(hold("db/t1")).await.unwrap();
    let third = page.executor.submit(hold("db/t1")).await.unwrap();
    let locks = page
        .json_when("locks", |locks| {
            let queue = locks["resources"]
                .as_array()
                .unwrap()
                .iter()
                .find(|r| r["resource"] == "db/t1")
                .map_or(0, |r| r["waiters"].as_array().unwrap().len());
            queue == 2
        })
        .await;
    let resources = locks["resources"].as_array().unwrap();
    let names: Vec<&str> = resources
        .iter()
        .map(|r| r["resource"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["db/t1", "pool"], "{locks}");
    assert_eq!(
        resources[0]["holders"],
        serde_json::json!([{ "id": first.0, "mode": "exclusive" }])
    );
    assert_eq!(
        resources[0]["waiters"],
        serde_json::json!([
            { "id": second.0, "mode": "exclusive" },
            { "id": third.0, "mode": "exclusive" }
        ]),
        "first come, first served"
    );
    assert_eq!(resources[1]["permits"], 2);
    let (_, html) = page.get("locks").await;
    assert!(html.contains("0 of 2 in use"), "{html}");
    assert!(html.contains("Wait-for cycles"), "{html}");
    page.executor.wake_event("release").await.unwrap();
    for id in [first, second, third] {
        page.executor.wait(id).await.unwrap().unwrap();
    }
    page.executor.clone().shutdown().await.unwrap();
}

#[actix::test]
async fn the_engine_page_shows_the_store_the_group_commit_and_recent_failures() {
    let page = page(AdminConfig::default()).await;
    let failed = page
        .executor
        .submit(Scripted::new(
            "doomed",
            vec![Step::More, Step::Fail("no disk".into())],
        ))
        .await
        .unwrap();
    assert!(page.executor.wait(failed).await.unwrap().is_err());
    let (status, engine) = page.json("engine").await;
    assert_eq!(status, 200, "{engine}");
    assert_eq!(engine["store"]["kind"], "memory");
    assert!(engine["store"]["facts"]["records"].is_string(), "{engine}");
    assert!(
        engine["commits"]["batches"].as_u64().unwrap() >= 1,
        "{engine}"
    );
    assert!(
        engine["commits"]["records"].as_u64().unwrap() >= 3,
        "{engine}"
    );
    let per_shard = engine["per_shard"].as_array().unwrap();
    assert_eq!(per_shard.len() as u64, engine["shards"].as_u64().unwrap());
    let failures = engine["recent_failures"].as_array().unwrap();
    assert_eq!(failures.len(), 1, "{engine}");
    assert_eq!(failures[0]["root"], failed.0);
    assert!(failures[0]["error"].as_str().unwrap().contains("no disk"));
    let (_, html) = page.get("engine").await;
    for part in [
        "Group commit",
        "Store (memory)",
        "Recent failures",
        "no disk",
        "id=\"shards\"",
    ] {
        assert!(html.contains(part), "{part} in {html}");
    }
    page.executor.clone().shutdown().await.unwrap();
}

#[actix::test]
async fn a_dags_tasks_and_edges_show_with_their_states() {
    let mut registry: Registry<Recorder> = common::registry();
    registry
        .register::<proctor::Dag<Waits>>("dag")
        .register::<proctor::DagTask<Waits>>("dag-task");
    let rec = Arc::new(Recorder::default());
    let executor = Executor::builder()
        .registry(registry)
        .store(proctor::MemoryStore::new())
        .env(rec.clone())
        .start()
        .await
        .unwrap();
    let page = serve(executor, AdminConfig::default()).await;
    let mut b = proctor::DagBuilder::new();
    let (x, y, z) = (b.add(Waits(false)), b.add(Waits(true)), b.add(Waits(false)));
    b.edge(x, y).edge(x, z);
    let dag = page.executor.submit(b.build().unwrap()).await.unwrap();
    // x done, y held in its step, z done.
    let tree = page
        .json_when(&format!("procedures/{}", dag.0), |tree| {
            let statuses: Vec<&str> = tree["dags"][0]["tasks"]
                .as_array()
                .map(|t| t.iter().map(|t| t["status"].as_str().unwrap()).collect())
                .unwrap_or_default();
            statuses == ["done", "started", "done"]
        })
        .await;
    let dag_json = &tree["dags"][0];
    assert_eq!(dag_json["id"], dag.0);
    assert_eq!(dag_json["edges"], serde_json::json!([[0, 1], [0, 2]]));
    // The running task's child procedure, named by its state name from its start
    // (finished ones have left the table).
    assert!(dag_json["tasks"][1]["procedure"].is_u64(), "{dag_json}");
    assert_eq!(dag_json["tasks"][1]["state"], "RUNNABLE", "{dag_json}");
    assert!(dag_json["tasks"][0]["procedure"].is_null(), "{dag_json}");
    let (_, html) = page.get(&format!("procedures/{}", dag.0)).await;
    assert!(html.contains(&format!("DAG {}", dag.0)), "{html}");
    assert!(html.contains("<td>#1</td><td>started</td>"), "{html}");
    rec.gate.notify_one();
    page.executor.wait(dag).await.unwrap().unwrap();
    page.executor.clone().shutdown().await.unwrap();
}

/// A DAG task: done at once, or holding its worker until the test opens the gate.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Waits(bool);

#[async_trait]
impl proctor::Task<Recorder> for Waits {
    async fn execute(&self, ctx: &mut Context<Recorder>) -> Result<(), ProcError> {
        if self.0 {
            ctx.env().gate.notified().await;
        }
        Ok(())
    }

    async fn rollback(&self, _ctx: &mut Context<Recorder>) -> Result<(), ProcError> {
        Ok(())
    }
}

/// A procedure stuck in a step is force-bypassed through the page (`force-bypass`, the
/// page offering it for a RUNNABLE procedure) and through the `proctor` command beside
/// the running engine (`bypass URL ID --force`); a plain bypass is refused saying
/// the bypass must be forced, by the page (409) and by the command (exit 1).
#[actix::test]
async fn a_procedure_stuck_in_a_step_is_force_bypassed_through_the_page_and_the_command() {
    let rec = Arc::new(Recorder::default());
    let executor = Executor::builder()
        .registry(common::registry())
        .store(proctor::MemoryStore::new())
        .workers(2)
        .env(rec.clone())
        .start()
        .await
        .unwrap();
    let page = serve(executor, AdminConfig::default().token(TOKEN)).await;
    let one = common::start_gated(&page.executor, &rec, "one").await;
    let two = common::start_gated(&page.executor, &rec, "two").await;
    let (_, html) = page.get("procedures").await;
    assert!(
        html.contains(&format!(
            r#"data-id="{}" data-action="force-bypass""#,
            one.0
        )),
        "{html}"
    );
    let (status, body) = page
        .post(&format!("procedures/{}/bypass", one.0), Some(TOKEN), None)
        .await;
    assert_eq!(status, 409, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("force the bypass"),
        "{body}"
    );
    let (status, body) = page
        .post(
            &format!("procedures/{}/force-bypass", one.0),
            Some(TOKEN),
            None,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(page.executor.wait(one).await.unwrap(), Ok(()));

    let base = page.base.clone();
    let cli = move |force: bool| {
        let base = base.clone();
        tokio::task::spawn_blocking(move || {
            let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_proctor"));
            command.args(["bypass", &base, &two.0.to_string()]);
            if force {
                command.arg("--force");
            }
            command.env("PROCTOR_ADMIN_TOKEN", TOKEN).output().unwrap()
        })
    };
    let refused = cli(false).await.unwrap();
    let said = String::from_utf8_lossy(&refused.stdout).into_owned();
    assert_eq!(refused.status.code(), Some(1), "{said}");
    assert!(said.contains("force the bypass"), "{said}");
    let done = cli(true).await.unwrap();
    let said = String::from_utf8_lossy(&done.stdout).into_owned();
    assert_eq!(
        done.status.code(),
        Some(0),
        "{said} {}",
        String::from_utf8_lossy(&done.stderr)
    );
    assert!(said.contains("bypassed procedure"), "{said}");
    assert_eq!(page.executor.wait(two).await.unwrap(), Ok(()));
    assert_eq!(rec.count("one-exec") + rec.count("two-exec"), 2);
    page.executor.clone().shutdown().await.unwrap();
}

/// A page over one engine of a cluster member, configured with the cluster's store:
/// `/engine` (JSON and page) shows the engine's role as its partition's owner and the
/// cluster — both members, every partition with the owner and epoch its engine runs
/// under, the coordinator, the moves that assigned the partitions. The Host check
/// still holds for it.
#[actix::test]
async fn the_engine_page_shows_the_cluster_and_the_partition_it_owns() {
    let schema = common::pg::fresh_schema();
    let url = common::pg::server().url();
    let options = || proctor::PgOptions::default().schema(&schema);
    let recorder = Arc::new(Recorder::default());
    let member = |name: &'static str| {
        let recorder = recorder.clone();
        proctor::Cluster::builder(url.clone(), name)
            .options(options())
            .partitions(8)
            .period(Duration::from_millis(900))
            .engines(move || {
                Executor::builder()
                    .registry(common::registry())
                    .env(recorder.clone())
                    .workers(2)
            })
            .start()
    };
    let a = member("a").await.expect("a joins");
    let b = member("b").await.expect("b joins");
    let started = std::time::Instant::now();
    while a.owned().len() != 4 || b.owned().len() != 4 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the partitions never spread: a {:?}, b {:?}",
            a.owned(),
            b.owned()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mine = a.owned()[0];
    let page = serve(
        a.engine(mine).expect("a runs its partition"),
        AdminConfig::default().cluster(url.clone(), options()),
    )
    .await;

    let (status, engine) = page.json("engine").await;
    assert_eq!(status, 200, "{engine}");
    let role = &engine["leadership"];
    assert_eq!(role["role"], "owner", "{engine}");
    assert_eq!(role["holder"], "a");
    assert_eq!(role["partition"], mine);
    let cluster = &engine["cluster"];
    let members: Vec<&str> = cluster["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert_eq!(members, ["a", "b"], "{cluster}");
    assert!(
        cluster["members"]
            .as_array()
            .unwrap()
            .iter()
            .all(|m| m["live"] == true && m["remaining_ms"].as_u64().is_some()),
        "{cluster}"
    );
    let partitions = cluster["partitions"].as_array().unwrap();
    assert_eq!(partitions.len(), 8, "{cluster}");
    for p in partitions {
        let partition = p["partition"].as_u64().unwrap() as u32;
        let (owner, member) = if a.owned().contains(&partition) {
            ("a", &a)
        } else {
            ("b", &b)
        };
        assert_eq!(p["owner"], owner, "{cluster}");
        let engine = member
            .engine(partition)
            .expect("an engine per owned partition");
        match engine.role().await.unwrap() {
            proctor::Role::Owner { epoch, .. } => assert_eq!(p["epoch"], epoch, "{cluster}"),
            other => panic!("partition {partition}'s engine is {other:?}"),
        }
    }
    assert_eq!(role["epoch"], partitions[mine as usize]["epoch"]);
    assert!(
        ["a", "b"].contains(&cluster["coordinator"].as_str().unwrap()),
        "{cluster}"
    );
    let moves = cluster["recent_moves"].as_array().unwrap();
    assert!(
        moves.iter().filter(|m| m["reason"] == "assigned").count() >= 8,
        "{cluster}"
    );

    let (status, html) = page.get("engine").await;
    assert_eq!(status, 200);
    for part in [
        format!("Owns partition {mine} of its cluster, in member a"),
        "8 partitions · 2 members (2 live)".to_string(),
        "id=\"members\"".to_string(),
        format!("<tr data-partition=\"{mine}\" class=\"current\"><td>{mine} (this engine)</td><td>a</td>"),
        "id=\"moves\"".to_string(),
        "assigned".to_string(),
    ] {
        assert!(html.contains(&part), "{part} in {html}");
    }
    assert!(html.contains("<td>b</td>"), "{html}");
    // The Host check holds for the cluster's view too.
    let foreign = page
        .get_with_host("engine", "attacker.example", "application/json")
        .await;
    assert_eq!(foreign.status().as_u16(), 421);

    // A schema without a cluster shows none; a store that cannot be reached, an
    // error; the engine's own facts are answered either way.
    let none = serve(
        a.engine(mine).unwrap(),
        AdminConfig::default().cluster(
            url.clone(),
            proctor::PgOptions::default().schema("no_cluster_here"),
        ),
    )
    .await;
    let (status, engine) = none.json("engine").await;
    assert_eq!(status, 200, "{engine}");
    assert!(engine["cluster"].is_null(), "{engine}");
    assert!(none
        .get("engine")
        .await
        .1
        .contains("the store holds no cluster"));
    let unreachable = serve(
        a.engine(mine).unwrap(),
        AdminConfig::default().cluster(
            "host=127.0.0.1 port=1 user=nobody connect_timeout=2",
            options(),
        ),
    )
    .await;
    let (status, engine) = unreachable.json("engine").await;
    assert_eq!(status, 200, "{engine}");
    let error = engine["cluster"]["error"].as_str().unwrap();
    assert!(error.starts_with("reading the cluster"), "{error}");
    assert!(engine["workers"].as_u64().unwrap() > 0, "{engine}");
    let (_, html) = unreachable.get("engine").await;
    assert!(
        html.contains("<p id=\"cluster\" class=\"error\">reading the cluster"),
        "{html}"
    );

    a.leave().await.expect("a leaves");
    b.leave().await.expect("b leaves");
}
