//! The admin page's HTML: one layout, a renderer per page, the stylesheet and the
//! script. Everything a page shows is escaped; nothing comes from a CDN.

use std::fmt::Write;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::response::Html;
use serde_json::{json, Value};

use crate::dag::SummaryView;
use crate::{LockMode, LockReport, ProcId, ProcInfo, ProcState, TaskStatus, TreeInfo};

pub(super) const CSS: &str = r#"
body { font: 14px/1.4 system-ui, sans-serif; margin: 0; color: #1d2330; }
header { background: #1d2330; color: #fff; padding: 8px 16px; display: flex; gap: 16px; align-items: center; }
header a { color: #cfe0ff; text-decoration: none; }
header .live { margin-left: auto; font-size: 12px; }
header .live.on::before { content: "● "; color: #4cd964; }
header .live.off::before { content: "● "; color: #ff6b6b; }
main { padding: 12px 16px; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: 4px 8px; border-bottom: 1px solid #e3e6ee; vertical-align: top; }
th { background: #f3f5fa; }
tr.new { background: #fffbe0; }
tr.updated { background: #eef6ff; }
.state-SUCCESS { color: #1f7a33; } .state-ROLLEDBACK, .state-FAILED { color: #b02a2a; }
.state-PAUSED, .state-ROLLBACK_PAUSED { color: #a36500; }
form.filters { display: flex; gap: 8px; margin-bottom: 10px; align-items: end; }
button.act { font-size: 12px; }
.tree ul { list-style: none; padding-left: 20px; border-left: 1px dotted #aab; }
.tree .current, tr.current { font-weight: bold; }
.error { color: #b02a2a; }
#msg { margin: 8px 0; }
"#;

pub(super) const JS: &str = r#"
// Live: one line a tick from the feed, folding what the engine published since. The
// page names the rows it shows (their finish or pause comes back) and, on the first
// page of the whole list, asks for the newest roots as rows.
(function () {
  const live = document.getElementById('live');
  const body = document.getElementById('procs');
  const params = [];
  if (body) {
    const ids = Array.from(body.querySelectorAll('tr[data-id]'), (r) => r.dataset.id);
    if (ids.length) params.push('watch=' + ids.slice(0, 1000).join(','));
    if (body.hasAttribute('data-new-rows')) params.push('new=true');
  }
  let submitted = 0, finished = 0;
  const source = new EventSource(document.body.dataset.base + 'events' + (params.length ? '?' + params.join('&') : ''));
  source.onopen = () => { live.className = 'live on'; live.textContent = 'live'; };
  source.onerror = () => { live.className = 'live off'; live.textContent = 'reconnecting'; };
  const mark = (row, state) => {
    row.classList.add('updated');
    row.children[3].textContent = state;
    row.children[3].className = 'state-' + state;
  };
  source.onmessage = (m) => {
    const tick = JSON.parse(m.data);
    submitted += tick.submitted;
    finished += tick.succeeded + tick.rolled_back;
    live.className = 'live on';
    live.textContent = 'live · ' + submitted + ' submitted · ' + finished + ' finished';
    if (tick.leadership) live.title = tick.leadership;
    if (tick.stopped) { live.className = 'live off'; live.textContent = 'the engine stopped'; source.close(); }
    if (!body) return;
    for (const p of tick.new) {
      const row = document.createElement('tr');
      row.className = 'new';
      row.dataset.id = p.id;
      row.innerHTML = '<td><a></a></td><td></td><td></td><td>RUNNABLE</td><td colspan="7">new</td>';
      row.querySelector('a').textContent = p.id;
      row.querySelector('a').href = document.body.dataset.base + 'procedures/' + p.id;
      row.children[1].textContent = p.type;
      row.children[2].textContent = p.id;
      if (p.state) mark(row, p.state);
      body.prepend(row);
    }
    const added = body.querySelectorAll('tr.new');
    for (let i = 100; i < added.length; i++) added[i].remove();
    for (const p of tick.changed) {
      const row = body.querySelector('tr[data-id="' + p.id + '"]');
      if (row) mark(row, p.state);
    }
  };
})();
// Actions: confirm, then POST with the bearer token (asked once per tab) and the CSRF token.
document.addEventListener('click', async (e) => {
  const button = e.target.closest('button.act');
  if (!button) return;
  const { id, action } = button.dataset;
  if (!confirm(action + ' procedure ' + id + '?')) return;
  let token = sessionStorage.getItem('proctor-token');
  if (!token) { token = prompt('Admin token'); if (!token) return; sessionStorage.setItem('proctor-token', token); }
  const csrf = document.querySelector('meta[name=csrf-token]').content;
  const url = document.body.dataset.base + 'procedures/' + id + '/' + action + (button.dataset.recursive ? '?recursive=true' : '');
  const answer = await fetch(url, { method: 'POST', headers: { 'Authorization': 'Bearer ' + token, 'x-csrf-token': csrf } });
  const body = await answer.json().catch(() => ({}));
  const msg = document.getElementById('msg');
  if (answer.ok) { msg.className = ''; msg.textContent = action + ' ' + id + ': ' + JSON.stringify(body); }
  else {
    msg.className = 'error'; msg.textContent = action + ' ' + id + ' refused (' + answer.status + '): ' + (body.error || '');
    if (answer.status === 401 || answer.status === 403) sessionStorage.removeItem('proctor-token');
  }
});
"#;

/// Escapes text for HTML.
pub(super) fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// The layout around a page's body. Links are relative to the admin root, wherever it
/// is nested: `base` leads from the page back to it (`""` for a page at the root,
/// `"../"` one level below).
pub(super) fn html(csrf: &str, base: &str, title: &str, body: &str) -> Html<String> {
    Html(format!(
        r#"<!doctype html>
<html><head><meta charset="utf-8"><title>proctor · {title}</title>
<meta name="csrf-token" content="{csrf}">
<link rel="stylesheet" href="{base}assets/admin.css"></head>
<body data-base="{base}">
<header><strong>proctor</strong>
<a href="{base}procedures">Procedures</a><a href="{base}locks">Locks</a><a href="{base}engine">Engine</a>
<span id="live" class="live off">connecting</span></header>
<main><h2>{title}</h2><div id="msg"></div>{body}</main>
<script src="{base}assets/admin.js"></script></body></html>"#,
        title = esc(title),
        csrf = esc(csrf),
    ))
}

/// What the procedures page was asked for.
pub(super) struct ProcView {
    pub(super) state: String,
    pub(super) type_name: String,
    pub(super) tree: String,
    pub(super) page: usize,
    pub(super) per_page: usize,
    pub(super) total: usize,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn age(submitted_ms: u64) -> String {
    let s = now_ms().saturating_sub(submitted_ms) / 1000;
    match s {
        0..=119 => format!("{s}s"),
        120..=7199 => format!("{}m", s / 60),
        _ => format!("{}h", s / 3600),
    }
}

fn waits(p: &ProcInfo) -> String {
    if matches!(p.state, ProcState::Paused | ProcState::RollbackPaused) {
        // Why, as `proctor procs` says it: the error that paused it, its policy and the
        // retries it spent.
        return match &p.steering.paused {
            Some(paused) => match (&paused.error, &paused.policy) {
                (None, _) => "an operator (paused by an operator)".into(),
                (Some(error), Some(policy)) => format!(
                    "an operator: {error} (policy {policy:?}, {} retries)",
                    paused.retries
                ),
                (Some(error), None) => {
                    format!("an operator: {error} (past its point of no return)")
                }
            },
            None => "an operator".into(),
        };
    }
    match &p.waiting_on {
        None => String::new(),
        Some(crate::WaitingOn::Children) => "children".into(),
        Some(crate::WaitingOn::Event(e)) => match e.strip_prefix("proctor.remote/") {
            Some(op) => format!("remote operation {op}"),
            None => format!("event {e}"),
        },
        Some(crate::WaitingOn::Timer { at_ms }) => {
            format!("timer in {}s", at_ms.saturating_sub(now_ms()) / 1000)
        }
        Some(crate::WaitingOn::Locks) => "locks".into(),
    }
}

fn actions(p: &ProcInfo) -> String {
    if matches!(p.state, ProcState::Success | ProcState::RolledBack) {
        return String::new();
    }
    let mut out = String::new();
    for action in ["abort", "pause", "resume", "rollback"] {
        let _ = write!(
            out,
            r#"<button class="act" data-id="{}" data-action="{action}">{action}</button> "#,
            p.id.0
        );
    }
    let _ = write!(
        out,
        r#"<button class="act" data-id="{}" data-action="bypass" data-recursive="yes">bypass</button>"#,
        p.id.0
    );
    // Queued or in a step: only a forced bypass takes it (its step is dropped).
    if p.state == ProcState::Runnable {
        let _ = write!(
            out,
            r#" <button class="act" data-id="{}" data-action="force-bypass" data-recursive="yes">force bypass</button>"#,
            p.id.0
        );
    }
    out
}

fn row(p: &ProcInfo, link: &str) -> String {
    let failure = p
        .result
        .as_ref()
        .and_then(|r| r.as_ref().err())
        .map(ToString::to_string)
        .unwrap_or_default();
    format!(
        r#"<tr data-id="{id}" data-state="{state}"><td><a href="{link}{id}">{id}</a></td><td>{ty}</td><td>{root}</td><td class="state-{state}">{state}</td><td>{name}</td><td>{steps}</td><td>{age}</td><td>{waits}</td><td>{level}</td><td>{failure}</td><td>{actions}</td></tr>"#,
        id = p.id.0,
        ty = esc(p.type_name),
        root = p.root.0,
        state = p.state,
        name = esc(p.state_name.as_deref().unwrap_or("")),
        steps = p.steps.map(|n| n.to_string()).unwrap_or_default(),
        age = age(p.submitted_ms),
        waits = esc(&waits(p)),
        level = p.queue_level.map(|l| l.to_string()).unwrap_or_default(),
        failure = esc(&failure),
        actions = actions(p),
    )
}

const HEAD: &str = "<tr><th>id</th><th>type</th><th>tree</th><th>state</th><th>step</th><th>steps</th><th>age</th><th>waits for</th><th>level</th><th>failure</th><th>actions</th></tr>";

pub(super) fn procedures(view: &ProcView, shown: &[ProcInfo], states: &[ProcState]) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        r#"<form class="filters" method="get"><label>state <select name="state"><option value="">any</option>"#
    );
    for s in states {
        let selected = if s.to_string() == view.state {
            " selected"
        } else {
            ""
        };
        let _ = write!(out, r#"<option{selected}>{s}</option>"#);
    }
    let _ = write!(
        out,
        r#"</select></label><label>type <input name="type" value="{}"></label><label>tree <input name="tree" size="8" value="{}"></label><button>filter</button></form>"#,
        esc(&view.type_name),
        esc(&view.tree)
    );
    let pages = view.total.div_ceil(view.per_page).max(1);
    let _ = write!(
        out,
        r#"<p>{} procedures · page {} of {pages}"#,
        view.total, view.page
    );
    let query = |page: usize| {
        format!(
            "?state={}&type={}&tree={}&per_page={}&page={page}",
            esc(&view.state),
            esc(&view.type_name),
            esc(&view.tree),
            view.per_page
        )
    };
    if view.page > 1 {
        let _ = write!(out, r#" · <a href="{}">previous</a>"#, query(view.page - 1));
    }
    if view.page < pages {
        let _ = write!(out, r#" · <a href="{}">next</a>"#, query(view.page + 1));
    }
    // New roots are added live only to the first page of the unfiltered list: a
    // filtered page would show rows its filter does not match.
    let unfiltered = view.state.is_empty() && view.type_name.is_empty() && view.tree.is_empty();
    let new_rows = if view.page == 1 && unfiltered {
        " data-new-rows"
    } else {
        ""
    };
    let _ = write!(
        out,
        r#"</p><table><thead>{HEAD}</thead><tbody id="procs"{new_rows}>"#
    );
    for p in shown {
        out.push_str(&row(p, "procedures/"));
    }
    out.push_str("</tbody></table>");
    out
}

pub(super) fn tree(
    root: ProcId,
    procs: &[ProcInfo],
    current: ProcId,
    execution: Option<&TreeInfo>,
    dags: &[Dag],
) -> String {
    fn node(out: &mut String, procs: &[ProcInfo], id: ProcId, current: ProcId) {
        let Some(p) = procs.iter().find(|p| p.id == id) else {
            return;
        };
        let class = if id == current {
            " class=\"current\""
        } else {
            ""
        };
        let _ = write!(
            out,
            r#"<li{class}><a href="{}">{}</a> {} <span class="state-{}">{}</span> {}"#,
            p.id.0,
            p.id.0,
            esc(p.type_name),
            p.state,
            p.state,
            esc(p.state_name.as_deref().unwrap_or(""))
        );
        let children: Vec<ProcId> = procs
            .iter()
            .filter(|c| c.parent == Some(id))
            .map(|c| c.id)
            .collect();
        if !children.is_empty() {
            out.push_str("<ul>");
            for child in children {
                node(out, procs, child, current);
            }
            out.push_str("</ul>");
        }
        out.push_str("</li>");
    }
    let mut out = String::from(r#"<div class="tree"><ul>"#);
    node(&mut out, procs, root, current);
    out.push_str("</ul></div>");
    let _ = write!(
        out,
        r#"<h3>Procedures</h3><table><thead>{HEAD}</thead><tbody>"#
    );
    for p in procs {
        out.push_str(&row(p, ""));
    }
    out.push_str("</tbody></table>");
    if let Some(t) = execution {
        execution_section(&mut out, t);
    }
    for dag in dags {
        dag.section(&mut out);
    }
    out
}

fn links(ids: &[ProcId], base: &str) -> String {
    ids.iter()
        .map(|id| format!(r#"<a href="{base}{0}">{0}</a>"#, id.0))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The execution stack (newest on top, as a rollback walks it) and the rollback so far.
fn execution_section(out: &mut String, t: &TreeInfo) {
    let _ = write!(
        out,
        r#"<h3>Execution stack</h3><p>{} steps, oldest first{}: <span id="stack">{}</span></p>"#,
        t.stack.len(),
        if t.rolling_back {
            "; the tree is rolling back, newest first"
        } else {
            ""
        },
        links(&t.stack, "")
    );
    if t.rolling_back || !t.rolled_back.is_empty() {
        let _ = write!(
            out,
            r#"<h3>Rollback so far</h3><p>{} steps undone, in order: <span id="rolled-back">{}</span></p>"#,
            t.rolled_back.len(),
            links(&t.rolled_back, "")
        );
    }
}

/// A DAG procedure of the tree, read from its state name, with its tasks' children.
pub(super) struct Dag {
    id: ProcId,
    view: SummaryView,
    /// The child procedure running each task, by task index, where one is listed.
    children: Vec<Option<(ProcId, ProcState)>>,
}

/// The DAG procedures among `procs` (those whose state name is a DAG's summary).
pub(super) fn dags(procs: &[ProcInfo]) -> Vec<Dag> {
    procs
        .iter()
        .filter_map(|p| {
            let view = SummaryView::parse(p.state_name.as_deref()?)?;
            let mut children = vec![None; view.statuses.len()];
            for c in procs.iter().filter(|c| c.parent == Some(p.id)) {
                let task = c.state_name.as_deref().and_then(crate::dag::task_named);
                if let Some(slot) = task.and_then(|t| children.get_mut(t)) {
                    *slot = Some((c.id, c.state));
                }
            }
            Some(Dag {
                id: p.id,
                view,
                children,
            })
        })
        .collect()
}

fn status_name(status: TaskStatus) -> &'static str {
    match status {
        TaskStatus::Waiting => "waiting",
        TaskStatus::Ready => "ready",
        TaskStatus::Started => "started",
        TaskStatus::Done => "done",
        TaskStatus::RolledBack => "rolled back",
    }
}

impl Dag {
    pub(super) fn json(&self) -> Value {
        let tasks: Vec<Value> = self
            .view
            .statuses
            .iter()
            .zip(&self.children)
            .enumerate()
            .map(|(i, (status, child))| {
                json!({
                    "task": i,
                    "status": status_name(*status),
                    "procedure": child.map(|(id, _)| id.0),
                    "state": child.map(|(_, s)| s.to_string()),
                })
            })
            .collect();
        json!({
            "id": self.id.0,
            "tasks": tasks,
            "edges": self.view.edges.as_ref().map(|e| e.iter().map(|(a, b)| [a, b]).collect::<Vec<_>>()),
        })
    }

    fn section(&self, out: &mut String) {
        let _ = write!(
            out,
            r#"<h3>DAG {0}</h3><table class="dag" data-dag="{0}"><thead><tr><th>task</th><th>status</th><th>procedure</th><th>after</th></tr></thead><tbody>"#,
            self.id.0
        );
        for (i, (status, child)) in self.view.statuses.iter().zip(&self.children).enumerate() {
            let after = self.view.edges.as_ref().map_or_else(
                || "(edges not listed)".to_string(),
                |edges| {
                    edges
                        .iter()
                        .filter(|(_, b)| *b as usize == i)
                        .map(|(a, _)| format!("#{a}"))
                        .collect::<Vec<_>>()
                        .join(" ")
                },
            );
            let child = child.map_or_else(String::new, |(id, state)| {
                format!(
                    r#"<a href="{0}">{0}</a> <span class="state-{state}">{state}</span>"#,
                    id.0
                )
            });
            let _ = write!(
                out,
                "<tr><td>#{i}</td><td>{}</td><td>{child}</td><td>{after}</td></tr>",
                status_name(*status)
            );
        }
        out.push_str("</tbody></table>");
    }
}

fn mode(m: LockMode) -> &'static str {
    match m {
        LockMode::Shared => "shared",
        LockMode::Exclusive => "exclusive",
    }
}

pub(super) fn locks_json(report: &LockReport) -> Value {
    let who = |v: &[(ProcId, LockMode)]| -> Vec<Value> {
        v.iter()
            .map(|(id, m)| json!({ "id": id.0, "mode": mode(*m) }))
            .collect()
    };
    let resources: Vec<Value> = report
        .resources
        .iter()
        .map(|r| {
            json!({
                "resource": r.resource,
                "permits": r.permits,
                "holders": who(&r.holders),
                "waiters": who(&r.waiters),
            })
        })
        .collect();
    let standing: Vec<Value> = report
        .standing
        .iter()
        .map(|(waiter, procs)| {
            json!({ "waiter": waiter.0, "cycle": procs.iter().map(|p| p.0).collect::<Vec<_>>() })
        })
        .collect();
    let cycles: Vec<Value> = report
        .cycles
        .iter()
        .map(|c| {
            let edges: Vec<Value> = c
                .edges
                .iter()
                .map(|e| {
                    json!({
                        "waiter": e.waiter.0,
                        "waiter_root": e.waiter_root.0,
                        "wants": e.wants.iter().map(ToString::to_string).collect::<Vec<_>>(),
                        "blocker": e.blocker.0,
                        "blocker_root": e.blocker_root.0,
                        "held": e.held,
                    })
                })
                .collect();
            json!({ "at_ms": c.at_ms, "edges": edges, "resolution": c.resolution })
        })
        .collect();
    json!({ "resources": resources, "standing": standing, "cycles": cycles })
}

pub(super) fn locks(report: &LockReport) -> String {
    let who = |v: &[(ProcId, LockMode)]| {
        v.iter()
            .map(|(id, m)| format!(r#"<a href="procedures/{0}">{0}</a> ({1})"#, id.0, mode(*m)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut out = String::from(
        r#"<table id="resources"><thead><tr><th>resource</th><th>permits</th><th>holders</th><th>queue (first served first)</th></tr></thead><tbody>"#,
    );
    for r in &report.resources {
        let permits = r.permits.map_or_else(String::new, |n| {
            let shared = r
                .holders
                .iter()
                .filter(|(_, m)| *m == LockMode::Shared)
                .count();
            format!("{shared} of {n} in use")
        });
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{permits}</td><td>{}</td><td>{}</td></tr>",
            esc(&r.resource),
            who(&r.holders),
            who(&r.waiters)
        );
    }
    if report.resources.is_empty() {
        out.push_str(r#"<tr><td colspan="4">no lock held or awaited</td></tr>"#);
    }
    out.push_str("</tbody></table>");
    out.push_str("<h3>Wait-for cycles</h3>");
    if report.standing.is_empty() && report.cycles.is_empty() {
        out.push_str("<p>none found</p>");
    }
    for (waiter, procs) in &report.standing {
        let _ = write!(
            out,
            r#"<p class="cycle">standing (may end by itself): the wait of <a href="procedures/{0}">{0}</a> closes a cycle through {1}</p>"#,
            waiter.0,
            links(procs, "procedures/")
        );
    }
    if !report.cycles.is_empty() {
        out.push_str(r#"<table id="cycles"><thead><tr><th>when</th><th>waits</th><th>what the engine did</th></tr></thead><tbody>"#);
        for c in report.cycles.iter().rev() {
            let waits: Vec<String> = c
                .edges
                .iter()
                .map(|e| {
                    let wants: Vec<String> = e.wants.iter().map(ToString::to_string).collect();
                    format!(
                        r#"<a href="procedures/{0}">{0}</a> waits for [{1}] {2} <a href="procedures/{3}">{3}</a>"#,
                        e.waiter.0,
                        esc(&wants.join(", ")),
                        if e.held { "held by" } else { "queued behind" },
                        e.blocker.0
                    )
                })
                .collect();
            let _ = write!(
                out,
                "<tr><td>{} ago</td><td>{}</td><td>{}</td></tr>",
                age(c.at_ms),
                waits.join("<br>"),
                esc(&c.resolution)
            );
        }
        out.push_str("</tbody></table>");
    }
    out
}

/// A table of a JSON object's scalar fields.
fn facts(out: &mut String, id: &str, map: &serde_json::Map<String, Value>) {
    let _ = write!(out, r#"<table id="{id}"><tbody>"#);
    for (key, value) in map {
        if value.is_object() || (value.is_array() && key != "queued_by_level" && key != "by_size") {
            continue;
        }
        let text = match value {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        let _ = write!(out, "<tr><th>{}</th><td>{}</td></tr>", esc(key), esc(&text));
    }
    out.push_str("</tbody></table>");
}

pub(super) fn engine(body: &Value) -> String {
    let mut out = String::from("<h3>Workers and queues</h3>");
    let empty = serde_json::Map::new();
    // The cluster has a section of its own (and is `null` in a schema without one).
    let mut top = body.as_object().cloned().unwrap_or_default();
    top.remove("cluster");
    facts(&mut out, "workers", &top);
    out.push_str(r#"<table id="shards"><thead><tr><th>shard</th><th>workers (system ones included)</th><th>busy</th><th>queued</th></tr></thead><tbody>"#);
    for (i, s) in body["per_shard"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        let _ = write!(
            out,
            "<tr><td>{i}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            s["workers"], s["running"], s["queued"]
        );
    }
    out.push_str("</tbody></table>");
    out.push_str("<h3>Role</h3>");
    let _ = write!(
        out,
        r#"<p id="role">{}</p>"#,
        esc(&role_sentence(&body["leadership"]))
    );
    facts(
        &mut out,
        "leadership",
        body["leadership"].as_object().unwrap_or(&empty),
    );
    if let Some(cluster) = body.get("cluster") {
        cluster_section(&mut out, cluster, &body["leadership"]);
    }
    let _ = write!(
        out,
        "<h3>Store ({})</h3>",
        esc(body["store"]["kind"].as_str().unwrap_or("?"))
    );
    facts(
        &mut out,
        "store",
        body["store"]["facts"].as_object().unwrap_or(&empty),
    );
    out.push_str("<h3>Group commit</h3>");
    facts(
        &mut out,
        "commits",
        body["commits"].as_object().unwrap_or(&empty),
    );
    out.push_str("<h3>Recent failures</h3>");
    let failures = body["recent_failures"]
        .as_array()
        .map_or(&[][..], Vec::as_slice);
    if failures.is_empty() {
        out.push_str("<p>none since the start</p>");
    } else {
        out.push_str(r#"<table id="failures"><thead><tr><th>when</th><th>tree</th><th>type</th><th>failed</th><th>error</th></tr></thead><tbody>"#);
        for f in failures.iter().rev() {
            let _ = write!(
                out,
                r#"<tr><td>{} ago</td><td><a href="procedures/{1}">{1}</a></td><td>{2}</td><td><a href="procedures/{3}">{3}</a> {4}</td><td class="error">{5}</td></tr>"#,
                age(f["at_ms"].as_u64().unwrap_or(0)),
                f["root"],
                esc(f["type"].as_str().unwrap_or("")),
                f["failed"],
                esc(f["failed_type"].as_str().unwrap_or("")),
                esc(f["error"].as_str().unwrap_or(""))
            );
        }
        out.push_str("</tbody></table>");
    }
    out
}

/// What the executor is to its store, in a sentence (from the engine JSON's
/// `leadership`).
fn role_sentence(role: &Value) -> String {
    let text = |key: &str| role[key].as_str().unwrap_or("?").to_string();
    match role["role"].as_str() {
        Some("alone") => "Alone on its store: no lease, no cluster.".to_string(),
        Some("leader") => format!(
            "Leads as {}: it holds the leader lease, epoch {}, which fences its writes.",
            text("holder"),
            role["epoch"]
        ),
        Some("standby") => format!(
            "Standby: it runs nothing until it takes the lease ({}).",
            role["leader"]
                .as_str()
                .map_or("no leader seen".to_string(), |l| format!(
                    "the leader is {l}"
                ))
        ),
        Some("owner") => format!(
            "Owns partition {} of its cluster, in member {}: it runs that partition's \
             procedures, its writes fenced with the partition's epoch, {}.",
            role["partition"],
            text("holder"),
            role["epoch"]
        ),
        Some("stepped_down") => format!(
            "Stepped down: {}. It runs and acknowledges nothing more.",
            text("reason")
        ),
        _ => format!("Unknown: {}", text("error")),
    }
}

/// The engine JSON's `cluster` ([`AdminConfig::cluster`](super::AdminConfig::cluster)):
/// the shape `proctor procs --pg` gives a cluster in its summary.
#[cfg(feature = "postgres")]
pub(super) fn cluster_json(state: &crate::ClusterState) -> Value {
    let members: Vec<Value> = state
        .members
        .iter()
        .map(|m| {
            json!({
                "name": m.name,
                "epoch": m.epoch,
                "live": m.remaining.is_some(),
                "remaining_ms": m.remaining.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            })
        })
        .collect();
    let partitions: Vec<Value> = state
        .partitions
        .iter()
        .map(|p| {
            json!({
                "partition": p.partition,
                "owner": p.owner,
                "epoch": p.epoch,
                "wanted": p.wanted,
                "moves": p.moves,
            })
        })
        .collect();
    let moves: Vec<Value> = state
        .recent_moves
        .iter()
        .map(|m| {
            json!({
                "at_ms": m.at_ms,
                "partition": m.partition,
                "from": m.from,
                "to": m.to,
                "epoch": m.epoch,
                "reason": m.reason,
            })
        })
        .collect();
    json!({
        "coordinator": state.coordinator,
        "moves": state.moves,
        "members": members,
        "partitions": partitions,
        "recent_moves": moves,
    })
}

/// The cluster's section of the engine page, from the engine JSON's `cluster`; the
/// partition this engine owns, if it owns one, is marked.
fn cluster_section(out: &mut String, cluster: &Value, role: &Value) {
    out.push_str("<h3>Cluster</h3>");
    if cluster.is_null() {
        out.push_str(r#"<p id="cluster">the store holds no cluster</p>"#);
        return;
    }
    if let Some(error) = cluster["error"].as_str() {
        let _ = write!(out, r#"<p id="cluster" class="error">{}</p>"#, esc(error));
        return;
    }
    let list = |key: &str| cluster[key].as_array().map_or(&[][..], Vec::as_slice);
    let name = |v: &Value| v.as_str().map_or_else(|| "-".to_string(), esc);
    let (members, partitions, moves) = (list("members"), list("partitions"), list("recent_moves"));
    let live: Vec<&str> = members
        .iter()
        .filter(|m| m["live"] == true)
        .filter_map(|m| m["name"].as_str())
        .collect();
    let _ = write!(
        out,
        r#"<p id="cluster">{} partitions · {} members ({} live) · coordinator {} · {} moves between members</p>"#,
        partitions.len(),
        members.len(),
        live.len(),
        cluster["coordinator"]
            .as_str()
            .map_or_else(|| "none (no live leader lease)".to_string(), esc),
        cluster["moves"]
    );
    out.push_str(r#"<table id="members"><thead><tr><th>member</th><th>epoch</th><th>membership</th></tr></thead><tbody>"#);
    for m in members {
        let membership = match m["remaining_ms"].as_u64() {
            Some(ms) => format!("live, {ms} ms left"),
            None => "expired".to_string(),
        };
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{membership}</td></tr>",
            name(&m["name"]),
            m["epoch"]
        );
    }
    out.push_str("</tbody></table>");
    let own = (role["role"] == "owner")
        .then(|| role["partition"].as_u64())
        .flatten();
    out.push_str(r#"<table id="partitions"><thead><tr><th>partition</th><th>owner</th><th>epoch</th><th>hand-off to</th><th>moves</th></tr></thead><tbody>"#);
    for p in partitions {
        let owner = match p["owner"].as_str() {
            Some(o) if live.contains(&o) => esc(o),
            Some(o) => format!("{} (expired)", esc(o)),
            None => "-".to_string(),
        };
        let this = own.is_some() && p["partition"].as_u64() == own;
        let _ = write!(
            out,
            r#"<tr data-partition="{0}"{1}><td>{0}{2}</td><td>{owner}</td><td>{3}</td><td>{4}</td><td>{5}</td></tr>"#,
            p["partition"],
            if this { r#" class="current""# } else { "" },
            if this { " (this engine)" } else { "" },
            p["epoch"],
            name(&p["wanted"]),
            p["moves"]
        );
    }
    out.push_str("</tbody></table>");
    out.push_str("<h3>Newest moves</h3>");
    if moves.is_empty() {
        out.push_str("<p>none</p>");
        return;
    }
    out.push_str(r#"<table id="moves"><thead><tr><th>when</th><th>partition</th><th>from</th><th>to</th><th>epoch</th><th>reason</th></tr></thead><tbody>"#);
    for m in moves {
        let at = m["at_ms"].as_u64().unwrap_or(0);
        let _ = write!(
            out,
            "<tr><td>{} ago</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            age(at),
            m["partition"],
            name(&m["from"]),
            name(&m["to"]),
            m["epoch"],
            name(&m["reason"])
        );
    }
    out.push_str("</tbody></table>");
}
