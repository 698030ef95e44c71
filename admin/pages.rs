//! The admin page's HTML: one layout, a renderer per page, the stylesheet and the
//! script. Everything a page shows is escaped; nothing comes from a CDN.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::response::Html;
use serde_json::Value;

use crate::{ProcId, ProcInfo, ProcState};

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
.tree .current { font-weight: bold; }
.error { color: #b02a2a; }
#msg { margin: 8px 0; }
"#;

pub(super) const JS: &str = r#"
// Live: count the events since the page loaded, and say whether the stream is up.
(function () {
  const live = document.getElementById('live');
  let seen = 0;
  const source = new EventSource(document.body.dataset.base + 'events');
  source.onopen = () => { live.className = 'live on'; live.textContent = 'live'; };
  source.onerror = () => { live.className = 'live off'; live.textContent = 'reconnecting'; };
  source.onmessage = (m) => {
    seen += 1;
    live.textContent = 'live · ' + seen + ' events';
    const event = JSON.parse(m.data);
    const body = document.getElementById('procs');
    if (body && event.event === 'submitted' && body.hasAttribute('data-new-rows')) {
      const row = document.createElement('tr');
      row.className = 'new';
      row.dataset.id = event.id;
      row.innerHTML = '<td><a></a></td><td></td><td></td><td>RUNNABLE</td><td colspan="6">new</td>';
      row.querySelector('a').textContent = event.id;
      row.querySelector('a').href = 'procedures/' + event.id;
      row.children[1].textContent = event.type;
      row.children[2].textContent = event.id;
      body.prepend(row);
    }
    if (body && event.event === 'finished') {
      const row = body.querySelector('tr[data-id="' + event.id + '"]');
      if (row) {
        row.classList.add('updated');
        row.children[3].textContent = event.state;
        row.children[3].className = 'state-' + event.state;
      }
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
    match &p.waiting_on {
        None => String::new(),
        Some(crate::WaitingOn::Children) => "children".into(),
        Some(crate::WaitingOn::Event(e)) => format!("event {e}"),
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
    for action in ["abort", "pause", "continue", "rollback"] {
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
        r#"<tr data-id="{id}" data-state="{state}"><td><a href="{link}{id}">{id}</a></td><td>{ty}</td><td>{root}</td><td class="state-{state}">{state}</td><td>{name}</td><td>{age}</td><td>{waits}</td><td>{level}</td><td>{failure}</td><td>{actions}</td></tr>"#,
        id = p.id.0,
        ty = esc(p.type_name),
        root = p.root.0,
        state = p.state,
        name = esc(p.state_name.as_deref().unwrap_or("")),
        age = age(p.submitted_ms),
        waits = esc(&waits(p)),
        level = p.queue_level.map(|l| l.to_string()).unwrap_or_default(),
        failure = esc(&failure),
        actions = actions(p),
    )
}

const HEAD: &str = "<tr><th>id</th><th>type</th><th>tree</th><th>state</th><th>step</th><th>age</th><th>waits for</th><th>level</th><th>failure</th><th>actions</th></tr>";

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

pub(super) fn tree(root: ProcId, procs: &[ProcInfo], current: ProcId) -> String {
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
    out
}

pub(super) fn locks(resources: &BTreeMap<String, (Vec<&ProcInfo>, Vec<&ProcInfo>)>) -> String {
    let mut out = String::from(
        "<table><thead><tr><th>lock</th><th>holders</th><th>waiters (first come, first served)</th></tr></thead><tbody>",
    );
    let links = |ps: &Vec<&ProcInfo>| {
        ps.iter()
            .map(|p| format!(r#"<a href="procedures/{0}">{0}</a>"#, p.id.0))
            .collect::<Vec<_>>()
            .join(" ")
    };
    for (lock, (holders, waiters)) in resources {
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{}</td></tr>",
            esc(lock),
            links(holders),
            links(waiters)
        );
    }
    if resources.is_empty() {
        out.push_str(r#"<tr><td colspan="3">no lock held or awaited</td></tr>"#);
    }
    out.push_str("</tbody></table>");
    out
}

pub(super) fn engine(body: &Value) -> String {
    let mut out = String::from("<table><tbody>");
    if let Some(map) = body.as_object() {
        for (key, value) in map {
            let _ = write!(
                out,
                "<tr><th>{}</th><td>{}</td></tr>",
                esc(key),
                esc(&value.to_string())
            );
        }
    }
    out.push_str("</tbody></table>");
    out
}
