"""
The trajectory viewer: what an agent did, the way a person reads it. report.py writes one static HTML
page (no server, no network: its script, style and data are inline, so it opens offline from disk)
from trajectories as train.py keeps them (trajectories.jsonl: a few groups of every step, with each
action token's advantage) or as rollout.py writes them.

The page lists the trajectories with their step, group, reward and finish reason, filtered by step,
reward and finish reason; one trajectory reads as a chat (system, user, each assistant turn with its
tool calls, each tool result), its sampled tokens one by one: a trained token's background is its
advantage (red above 0, blue below, as strong as the step's largest |advantage|), its tooltip the
advantage and the trainer's logprob minus the engine's where they were compared; the reward sits
where it landed, after the last action token. Beside it, the other members of its group.

The tokens' text was decoded when the trajectory was written (agent.token_texts), from the ids as
sampled: the page needs no tokenizer, and nothing is encoded again. The data goes into a
<script type="application/json"> with every "<" escaped, so no text (a tool result with "</script>")
can end it early.
"""

import json

# what the page shows of a record (the rest, ids and masks, stays in the JSONL)
SHOWN = ("step", "group", "member", "id", "answers", "reward", "scores", "finish_reason", "error", "trained",
         "left_out", "turns", "step_rewards", "messages", "tool_calls", "turn_tokens", "advantages",
         "logprob_diff")


def read_trajectories(path):
    """The records of a JSON Lines file of trajectories (train.py's trajectories.jsonl, rollout.py's
    --out). A last line that does not parse is one a kill cut short, and is left out; any other is an
    error naming its line."""
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    records = []
    for n, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except ValueError as e:
            if n < len(lines):
                raise ValueError(f"{path}:{n}: not a JSON line ({e})") from None
    for n, r in enumerate(records, 1):
        if not isinstance(r, dict) or "messages" not in r or "finish_reason" not in r:
            raise ValueError(f"{path}:{n}: not a trajectory (no messages or finish_reason): is it "
                             "train.py's trajectories.jsonl or rollout.py's output?")
    return records


def chosen_steps(records, steps=None):
    """The training steps to show: `steps` (each must be in records), else the first, middle and last."""
    present = sorted({r["step"] for r in records})
    if steps:
        missing = [s for s in steps if s not in present]
        if missing:
            raise ValueError(f"no trajectories of step {', '.join(map(str, missing))} were kept; steps "
                             f"kept: {', '.join(map(str, present)) or 'none'}")
        return sorted(set(steps))
    if not present:
        return []
    return sorted({present[0], present[len(present) // 2], present[-1]})


def page_entries(records, source):
    """The records as the page reads them: what it shows, and where they come from ("training",
    "rollout.py"). A rollout.py trajectory has no step, and is a group of its own."""
    entries = []
    for n, r in enumerate(records):
        entry = {k: r[k] for k in SHOWN if k in r}
        entry["source"] = source
        if source != "training":
            entry.update(step=None, group=n, member=0)
        entries.append(entry)
    return entries


def write_viewer(entries, path, title, note=""):
    """The page of these entries (page_entries) at path. note: a line under the title (what was left
    out)."""
    data = json.dumps({"title": title, "note": note, "trajectories": entries}, ensure_ascii=False)
    page = (PAGE.replace("@TITLE@", html_escape(title))
            .replace("@DATA@", data.replace("<", "\\u003c")))
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return path


def html_escape(text):
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>@TITLE@</title>
<style>
  body { font: 14px/1.45 system-ui, sans-serif; margin: 0; color: #1d1d1f; background: #f6f6f4; }
  header { padding: 10px 16px; background: #fff; border-bottom: 1px solid #ddd; }
  h1 { font-size: 17px; margin: 0 0 2px; }
  h2 { font-size: 14px; margin: 16px 0 6px; }
  .note, .legend { color: #555; font-size: 12px; }
  #filters { padding: 8px 16px; background: #fff; border-bottom: 1px solid #ddd; display: flex; gap: 14px;
             align-items: center; flex-wrap: wrap; }
  #filters input { width: 5em; }
  main { display: flex; align-items: flex-start; }
  #listpane { width: 430px; flex: none; max-height: calc(100vh - 110px); overflow: auto; background: #fff;
              border-right: 1px solid #ddd; }
  #list { border-collapse: collapse; width: 100%; font-size: 12px; }
  #list th, #list td { padding: 3px 6px; text-align: left; border-bottom: 1px solid #eee;
                       white-space: nowrap; }
  #list th { position: sticky; top: 0; background: #fafafa; }
  #list tbody tr { cursor: pointer; }
  #list tbody tr:hover { background: #f0f4fa; }
  #list tbody tr.selected { background: #dde8f6; }
  #detail { flex: 1; min-width: 0; padding: 10px 16px; max-height: calc(100vh - 110px); overflow: auto; }
  .facts { font-size: 12px; color: #444; margin-bottom: 8px; }
  .msg { background: #fff; border: 1px solid #ddd; border-radius: 6px; margin: 6px 0; padding: 6px 9px; }
  .msg .role { font-size: 11px; font-weight: 600; text-transform: uppercase; color: #666;
               margin-bottom: 3px; }
  .msg .text { white-space: pre-wrap; word-break: break-word; font-family: ui-monospace, monospace;
               font-size: 12.5px; }
  .msg.system .text { max-height: 9em; overflow: auto; }
  .msg.system { background: #f3f3f3; }
  .msg.user { background: #fffbe9; }
  .msg.assistant { background: #fff; border-color: #b9c7dc; }
  .msg.tool { background: #eef7ee; }
  .msg.outcome { background: #f7f0fb; font-size: 12px; }
  .tok.trained { border-bottom: 1px solid #999; box-shadow: inset -1px 0 0 rgba(255, 255, 255, 0.8); }
  .reward { display: inline-block; margin-left: 4px; padding: 0 5px; border-radius: 8px; background: #333;
            color: #fff; font: 600 11px system-ui, sans-serif; }
  .call { font-size: 12px; margin-top: 4px; font-family: ui-monospace, monospace; color: #234; }
  .call.error { color: #a00; }
  #group { display: flex; gap: 10px; overflow-x: auto; align-items: flex-start; }
  .member { flex: 0 0 340px; border: 2px solid transparent; border-radius: 8px; padding: 4px; }
  .member.selected { border-color: #5b84c4; }
  .member .head { font-size: 12px; font-weight: 600; cursor: pointer; }
  .member .msg { font-size: 11px; }
  .member .msg .text { font-size: 11px; }
</style>
</head>
<body>
<header>
  <h1 id="title"></h1>
  <div class="note" id="note"></div>
  <div class="legend">Sampled tokens: a trained token's background is its advantage (<span
    style="background: rgba(214, 39, 40, 0.6)">&nbsp;above 0&nbsp;</span> <span
    style="background: rgba(31, 119, 180, 0.6)">&nbsp;below 0&nbsp;</span>, full colour at the step's largest
    |advantage|); hover a token for its advantage and the trainer's logprob minus the engine's. Prompt and
    tool results are plain text; the reward is shown where it landed, after the last action token.</div>
</header>
<div id="filters">
  <label>step <select id="step"></select></label>
  <label>reward from <input id="reward-min" type="number" step="any"> to
    <input id="reward-max" type="number" step="any"></label>
  <label>finish <select id="finish"></select></label>
  <span id="count"></span>
</div>
<main>
  <div id="listpane">
    <table id="list">
      <thead><tr><th>step</th><th>group</th><th>#</th><th>reward</th><th>finish</th><th>turns</th>
        <th>calls</th><th>id</th></tr></thead>
      <tbody></tbody>
    </table>
  </div>
  <section id="detail">
    <div id="chat"></div>
    <h2 id="group-title"></h2>
    <div id="group"></div>
  </section>
</main>
<script type="application/json" id="data">@DATA@</script>
<script>
"use strict";
const data = JSON.parse(document.getElementById("data").textContent);
const trajs = data.trajectories;
trajs.forEach((t, i) => { t.index = i; });
const stepName = t => t.step === null ? t.source : "step " + t.step;

// the colour scale of each step: its largest |advantage|
const scale = {};
for (const t of trajs) {
  for (const turn of t.advantages || []) {
    for (const a of turn || []) scale[stepName(t)] = Math.max(scale[stepName(t)] || 0, Math.abs(a));
  }
}
function colour(a, s) {
  if (!a) return "";
  const alpha = (0.12 + 0.68 * Math.min(1, Math.abs(a) / (s || Math.abs(a)))).toFixed(3);
  return a > 0 ? `rgba(214, 39, 40, ${alpha})` : `rgba(31, 119, 180, ${alpha})`;
}
const signed = x => (x >= 0 ? "+" : "") + x.toFixed(4);
const fmt = x => (typeof x === "number" ? (Number.isInteger(x) ? String(x) : x.toFixed(3)) : String(x));

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

// one assistant turn: its sampled tokens, a trained one coloured by its advantage
function turnTokens(t, k, fallback) {
  const box = el("div", "text");
  const texts = (t.turn_tokens || [])[k];
  if (!texts) {
    box.textContent = fallback;
    return box;
  }
  const advantages = (t.advantages || [])[k], diffs = (t.logprob_diff || [])[k];
  texts.forEach((text, n) => {
    const span = el("span", "tok", text);
    if (advantages) {
      const a = advantages[n], d = diffs ? diffs[n] : null;
      span.classList.add("trained");
      span.style.backgroundColor = colour(a, scale[stepName(t)]);
      span.title = `advantage ${signed(a)} | logprob diff (trainer - engine) ` +
                   (d === null || d === undefined ? "not compared" : signed(d));
    } else {
      span.title = t.source === "training" ? `not trained: ${t.left_out || "left out"}` : "sampled token";
    }
    box.appendChild(span);
  });
  return box;
}

function message(role, cls) {
  const box = el("div", "msg " + cls);
  box.appendChild(el("div", "role", role));
  return box;
}

// the trajectory as a chat: the turns are the last `turns` assistant messages of its conversation;
// compact (a group's column): without the prompt, which the group shares
function chat(t, compact) {
  const out = el("div", "chat");
  const assistant = t.messages.map((m, i) => (m.role === "assistant" ? i : -1)).filter(i => i >= 0);
  const first = assistant.length - t.turns;  // the assistant message of turn 0 (< 0: some not in messages)
  const turnOf = {};
  assistant.forEach((i, n) => { if (n >= first) turnOf[i] = n - first; });
  const assistantTurn = (k, content) => {
    const reward = t.step_rewards && t.step_rewards[k];
    const box = message(`assistant · turn ${k + 1}` + (reward ? ` · step reward ${signed(reward)}` : ""),
                        "assistant");
    const text = turnTokens(t, k, content);
    if (k === t.turns - 1) text.appendChild(el("span", "reward", "reward " + fmt(t.reward)));
    box.appendChild(text);
    for (const c of (t.tool_calls || []).filter(c => c.turn === k)) {
      const call = el("div", "call" + (c.error ? " error" : ""),
                      "→ " + (c.name || "unparsed call") + " " + JSON.stringify(c.arguments) +
                      (c.error ? " (error)" : ""));
      box.appendChild(call);
    }
    return box;
  };
  for (let k = 0; k < -first; k++) {
    out.appendChild(assistantTurn(k, "(this turn is not in the final conversation)"));
  }
  const start = compact ? Math.min(...Object.keys(turnOf).map(Number), t.messages.length) : 0;
  t.messages.forEach((m, i) => {
    if (i < start) return;
    const content = typeof m.content === "string" ? m.content : JSON.stringify(m.content);
    if (i in turnOf) {
      out.appendChild(assistantTurn(turnOf[i], content));
    } else {
      const box = message(m.role, m.role === "tool" ? "tool" : m.role);
      box.appendChild(el("div", "text", content));
      out.appendChild(box);
    }
  });
  const outcome = message("outcome", "outcome");
  const facts = [`reward ${fmt(t.reward)}`, `finish ${t.finish_reason}`];
  for (const [k, v] of Object.entries(t.scores || {})) facts.push(`${k} ${fmt(v)}`);
  if (t.answers && t.answers.length) facts.push("answers " + t.answers.join(" | "));
  if (t.error) facts.push("error: " + t.error);
  if (t.trained === false) facts.push("left out of the update: " + t.left_out);
  outcome.appendChild(el("div", "", facts.join(" · ")));
  out.appendChild(outcome);
  return out;
}

const groupOf = t => trajs.filter(u => u.source === t.source && u.step === t.step && u.group === t.group);
let selected = null;

function select(t) {
  selected = t;
  for (const row of document.querySelectorAll("#list tbody tr")) {
    row.classList.toggle("selected", Number(row.dataset.index) === t.index);
  }
  const detail = document.getElementById("chat");
  detail.replaceChildren();
  detail.appendChild(el("div", "facts", `${stepName(t)} · group ${t.group} · member ${t.member} · ` +
                        `id ${t.id} · ${t.turns} turn${t.turns === 1 ? "" : "s"}`));
  detail.appendChild(chat(t));
  const members = groupOf(t);
  document.getElementById("group-title").textContent =
      members.length > 1 ? `Its group: the ${members.length} samples of this prompt side by side` : "";
  const group = document.getElementById("group");
  group.replaceChildren();
  if (members.length < 2) return;
  for (const u of members) {
    const column = el("div", "member" + (u === t ? " selected" : ""));
    const head = el("div", "head", `#${u.member} · reward ${fmt(u.reward)} · ${u.finish_reason}`);
    head.addEventListener("click", () => select(u));
    column.appendChild(head);
    column.appendChild(chat(u, true));
    group.appendChild(column);
  }
}

function options(id, values, labels) {
  const box = document.getElementById(id);
  for (const [n, v] of values.entries()) {
    const o = el("option", "", labels[n]);
    o.value = v;
    box.appendChild(o);
  }
  box.addEventListener("change", render);
}

function render() {
  const step = document.getElementById("step").value, finish = document.getElementById("finish").value;
  const low = parseFloat(document.getElementById("reward-min").value);
  const high = parseFloat(document.getElementById("reward-max").value);
  const shown = trajs.filter(t => (step === "" || stepName(t) === step) &&
                                  (finish === "" || t.finish_reason === finish) &&
                                  !(t.reward < low) && !(t.reward > high));
  const body = document.querySelector("#list tbody");
  body.replaceChildren();
  for (const t of shown) {
    const row = el("tr");
    row.dataset.index = t.index;
    const cells = [t.step === null ? t.source : t.step, t.group, t.member, fmt(t.reward), t.finish_reason,
                   t.turns, (t.tool_calls || []).length, t.id];
    for (const c of cells) row.appendChild(el("td", "", String(c)));
    row.addEventListener("click", () => select(t));
    body.appendChild(row);
  }
  document.getElementById("count").textContent = `${shown.length} of ${trajs.length} trajectories`;
  if (!shown.length) {
    selected = null;
    for (const id of ["chat", "group", "group-title"]) document.getElementById(id).replaceChildren();
  } else {
    select(shown.includes(selected) ? selected : shown[0]);
  }
}

document.getElementById("title").textContent = data.title;
document.getElementById("note").textContent = data.note;
const steps = [...new Set(trajs.map(stepName))];
options("step", ["", ...steps], ["all", ...steps]);
const reasons = [...new Set(trajs.map(t => t.finish_reason))].sort();
const counted = r => trajs.filter(t => t.finish_reason === r).length;
options("finish", ["", ...reasons], ["all", ...reasons.map(r => `${r} (${counted(r)})`)]);
for (const id of ["reward-min", "reward-max"]) document.getElementById(id).addEventListener("input", render);
render();
</script>
</body>
</html>
"""
