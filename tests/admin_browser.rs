//! The admin page in a real browser: headless Chromium, driven through chromedriver
//! (WebDriver). The `admin` example's engine keeps deploying; the test opens the
//! procedures page, sees rows arrive live, filters by state, opens a tree, aborts a
//! deployment that waits for approval with the token (confirming, and giving the token
//! when the page asks), sees its tree roll back, and opens the engine and locks pages,
//! all under the page's Content-Security-Policy (which blocks an inline script).
//! Screenshots of each stage go to `target/admin-screenshots/`. If Chromium or chromedriver cannot start, the test
//! fails and says why (`.ci/run` installs Debian's `chromium` and `chromium-driver`).

#[path = "../examples/admin.rs"]
#[allow(dead_code)]
mod demo;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use proctor::admin::AdminConfig;
use proctor::{List, ProcState};
use serde_json::json;

const TOKEN: &str = "browser-token";

/// chromedriver on a free loopback port; killed when dropped.
struct Driver {
    child: Child,
    port: u16,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn find(names: &[&str]) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    names.iter().find_map(|name| {
        std::env::split_paths(&path)
            .chain([
                PathBuf::from("/usr/bin"),
                PathBuf::from("/usr/lib/chromium"),
            ])
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    })
}

fn start_driver() -> Driver {
    let driver = find(&["chromedriver"]).unwrap_or_else(|| {
        panic!("no chromedriver on PATH or in /usr/bin: install Debian's chromium-driver")
    });
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let child = Command::new(&driver)
        .arg(format!("--port={port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{} does not start: {e}", driver.display()));
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "chromedriver never listened on {port}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Driver { child, port }
}

async fn browser(driver: &Driver, profile: &std::path::Path) -> Client {
    let chromium = find(&["chromium", "chromium-browser", "google-chrome"])
        .unwrap_or_else(|| panic!("no chromium on PATH or in /usr/bin: install Debian's chromium"));
    let options = json!({
        "binary": chromium,
        "args": [
            "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--window-size=1400,900",
            format!("--user-data-dir={}", profile.display()),
        ],
    });
    let mut capabilities = serde_json::Map::new();
    capabilities.insert("goog:chromeOptions".into(), options);
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    ClientBuilder::new(connector)
        .capabilities(capabilities)
        .connect(&format!("http://127.0.0.1:{}", driver.port))
        .await
        .unwrap_or_else(|e| panic!("Chromium does not start through chromedriver: {e}"))
}

fn shots() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/admin-screenshots");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

async fn shot(client: &Client, name: &str) {
    let png = client.screenshot().await.expect("screenshot");
    std::fs::write(shots().join(format!("{name}.png")), png).unwrap();
}

/// Clicks the element `css` finds.
async fn click(client: &Client, css: &str) {
    let element = client.find(Locator::Css(css)).await;
    element
        .unwrap_or_else(|e| panic!("no {css}: {e}"))
        .click()
        .await
        .unwrap();
}

/// The text of the element with id `id`.
async fn text_of(client: &Client, id: &str) -> String {
    let element = client.find(Locator::Id(id)).await;
    element
        .unwrap_or_else(|e| panic!("no #{id}: {e}"))
        .text()
        .await
        .unwrap()
}

/// Polls `check` (a page's state) until it holds, for at most 20 s.
async fn until<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(20);
    while !check().await {
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_watches_filters_opens_a_tree_and_aborts_it() {
    let executor = demo::engine().await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}/", listener.local_addr().unwrap());
    tokio::spawn(
        AdminConfig::default()
            .token(TOKEN)
            .serve_on(listener, executor.clone()),
    );
    let load = tokio::spawn(demo::keep_deploying(
        executor.clone(),
        Duration::from_millis(100),
    ));

    let driver = start_driver();
    let profile = tempfile::tempdir().unwrap();
    let client = browser(&driver, profile.path()).await;

    // Rows arrive live.
    client.goto(&format!("{base}procedures")).await.unwrap();
    until("the page is live and new rows arrive", || async {
        let live = text_of(&client, "live").await;
        let new_rows = client.find_all(Locator::Css("tr.new")).await.unwrap().len();
        live.contains("submitted") && new_rows >= 2
    })
    .await;
    shot(&client, "1-procedures-live").await;

    // The page works under its Content-Security-Policy: its script runs (the rows above
    // came through it and its live feed), its stylesheet applies, and a script put
    // inline into the page does not run.
    let header = client
        .execute(
            "return getComputedStyle(document.querySelector('header')).backgroundColor",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(header, json!("rgb(29, 35, 48)"), "the stylesheet applies");
    let inline = client
        .execute(
            "const s = document.createElement('script'); \
             s.textContent = 'window.inlineRan = true'; document.body.append(s); \
             return window.inlineRan === true",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(inline, json!(false), "the policy blocks inline scripts");

    // Filter: the deployments waiting (for approval, or for their child).
    let approval = loop {
        let waiting = executor
            .list(List::new().state(ProcState::Waiting))
            .await
            .unwrap();
        if let Some(p) = waiting.iter().find(|p| {
            p.parent.is_none()
                && matches!(&p.waiting_on, Some(proctor::WaitingOn::Event(e)) if e == "approve")
        }) {
            break p.id;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let select = client
        .find(Locator::Css("select[name=state]"))
        .await
        .unwrap();
    select.select_by_label("WAITING").await.unwrap();
    click(&client, "form.filters button").await;
    until("the filter is applied", || async {
        client
            .current_url()
            .await
            .unwrap()
            .as_str()
            .contains("state=WAITING")
    })
    .await;
    // The page stays live: a listed procedure that finishes since is marked updated and
    // its cell shows the new state, while `data-state` keeps the state the server
    // rendered. Every row as rendered is WAITING, and a filtered page takes no new rows.
    let rows = client.find_all(Locator::Css("#procs tr")).await.unwrap();
    assert!(!rows.is_empty());
    for row in rows {
        let rendered = row.attr("data-state").await.unwrap();
        assert_eq!(rendered.as_deref(), Some("WAITING"));
    }
    assert!(client
        .find_all(Locator::Css("#procs tr.new"))
        .await
        .unwrap()
        .is_empty());
    shot(&client, "2-filtered").await;

    // Open the tree of a deployment waiting for approval.
    click(
        &client,
        &format!("#procs a[href=\"procedures/{}\"]", approval.0),
    )
    .await;
    until("the tree page", || async {
        client
            .title()
            .await
            .unwrap()
            .contains(&format!("Tree {approval}"))
    })
    .await;
    assert!(client.find(Locator::Css(".tree li.current")).await.is_ok());
    // A live tree shows its execution stack: the root's steps and its child's.
    assert!(!text_of(&client, "stack").await.is_empty());
    shot(&client, "3-tree").await;

    // Abort it: confirm, give the token, and see the answer.
    let abort = format!("button.act[data-action=abort][data-id=\"{}\"]", approval.0);
    click(&client, &abort).await;
    client.accept_alert().await.expect("the confirmation");
    client
        .send_alert_text(TOKEN)
        .await
        .expect("the token prompt");
    client.accept_alert().await.unwrap();
    until("the abort is answered", || async {
        text_of(&client, "msg").await.contains("accepted")
    })
    .await;
    let result = executor.wait(approval).await.unwrap();
    assert!(result.is_err(), "the aborted tree rolled back");
    client.refresh().await.unwrap();
    until("the tree shows ROLLEDBACK", || async {
        client.source().await.unwrap().contains("ROLLEDBACK")
    })
    .await;
    shot(&client, "4-rolled-back").await;

    // The engine and the locks, as a browser renders them.
    client.goto(&format!("{base}engine")).await.unwrap();
    for table in ["workers", "shards", "store", "commits"] {
        assert!(
            client.find(Locator::Id(table)).await.is_ok(),
            "the engine page's {table}"
        );
    }
    // The aborted tree is among the recent failures.
    let source = client.source().await.unwrap();
    assert!(
        source.contains(&format!("href=\"procedures/{}\"", approval.0)),
        "{source}"
    );
    shot(&client, "5-engine").await;
    client.goto(&format!("{base}locks")).await.unwrap();
    assert!(client.find(Locator::Id("resources")).await.is_ok());
    shot(&client, "6-locks").await;

    load.abort();
    client.close().await.unwrap();
    executor.shutdown().await.unwrap();
}
