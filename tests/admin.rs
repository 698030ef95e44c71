//! The admin page over HTTP: every page and its JSON, filters and paging, bad input
//! answered 400 with a message, actions refused without a token (401), with a wrong
//! one (403) or without the CSRF token (403), an abort through the endpoint rolling a
//! tree back, and the live event stream.

mod common;

use std::sync::Arc;

use common::{Recorder, Scripted, Step};
use proctor::admin::AdminConfig;
use proctor::{Executor, ProcId, ProcState};
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
        let mut request = self.http.post(format!("{}{path}", self.base));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        if let Some(csrf) = csrf {
            request = request.header("x-csrf-token", csrf);
        }
        let answer = request.send().await.unwrap();
        (answer.status().as_u16(), answer.json().await.unwrap())
    }

    /// The CSRF token the pages carry.
    async fn csrf(&self) -> String {
        let (_, html) = self.get("procedures").await;
        let needle = "name=\"csrf-token\" content=\"";
        let at = html.find(needle).unwrap() + needle.len();
        html[at..at + 32].to_string()
    }
}

async fn page(config: AdminConfig) -> Page {
    let executor = Executor::builder()
        .registry(common::registry())
        .store(proctor::MemoryStore::new())
        .env(Arc::new(Recorder::default()))
        .start()
        .await
        .unwrap();
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
    let (status, locks) = page.json("locks").await;
    assert_eq!(status, 200);
    assert!(locks["locks"].as_array().unwrap().is_empty());
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
    let (status, body) = page.post(&abort, Some(TOKEN), None).await;
    assert_eq!(status, 403);
    assert!(body["error"].as_str().unwrap().contains("CSRF"), "{body}");
    let (status, body) = page.post(&abort, Some(TOKEN), Some("0000")).await;
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

    let (status, body) = page.post(&abort, Some(TOKEN), Some(&csrf)).await;
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

#[actix::test]
async fn the_event_stream_carries_submits_and_finishes() {
    let page = page(AdminConfig::default()).await;
    let mut stream = page
        .http
        .get(format!("{}events", page.base))
        .send()
        .await
        .unwrap();
    assert_eq!(stream.headers()["content-type"], "text/event-stream");
    let id = page
        .executor
        .submit(Scripted::new("seen", vec![Step::More]))
        .await
        .unwrap();
    let mut text = String::new();
    while !text.contains("\"event\":\"finished\"") {
        let chunk = stream.chunk().await.unwrap().expect("the stream goes on");
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(
        text.contains(&format!("\"event\":\"submitted\",\"id\":{}", id.0)),
        "{text}"
    );
    assert!(text.contains("\"state\":\"SUCCESS\""), "{text}");
    page.executor.clone().shutdown().await.unwrap();
}
