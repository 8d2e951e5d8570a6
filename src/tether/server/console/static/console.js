// tether console: confirmations for actions, a run page that refreshes itself (its
// actions too) when its event stream reports a new event (no polling of finished runs), and a runs list
// that refreshes when the changes stream says a run it may show changed. Both streams
// reconnect after a blip or a server restart; the run page says when it is not live.
document.addEventListener("submit", (ev) => {
  const question = ev.target.getAttribute("data-confirm");
  if (question && !window.confirm(question)) ev.preventDefault();
});

// An event stream that outlives connection blips and server restarts: the browser's
// EventSource reconnects by itself (resuming with Last-Event-ID); when it gives up (an
// error answer, e.g. from a proxy while the server restarts) a new one is made, after
// 1 s, 2 s, ... at most 30 s. onState(true/false) says whether the page is live;
// onGiveUp() is told each time the browser gave up (the page may refresh: a session
// that ended then goes to the login page).
const follow = (url, onState, setup, onGiveUp = () => {}) => {
  let source = null, delay = 1000, timer = null, lastId = "", over = false, wasLive = true;
  const state = (isLive) => {
    if (isLive !== wasLive) onState(isLive);
    wasLive = isLive;
  };
  const connect = () => {
    timer = null;
    const sep = url.includes("?") ? "&" : "?";
    source = new EventSource(lastId ? `${url}${sep}after=${encodeURIComponent(lastId)}` : url);
    source.addEventListener("open", () => { delay = 1000; state(true); });
    source.addEventListener("error", () => {
      if (over) return;
      state(false);
      if (source.readyState === EventSource.CLOSED && !timer) {
        timer = setTimeout(connect, delay);
        delay = Math.min(delay * 2, 30000);
        onGiveUp();
      }
    });
    setup(source, (e) => { if (e.lastEventId) lastId = e.lastEventId; });
  };
  connect();
  return {
    close: () => { over = true; if (timer) clearTimeout(timer); source.close(); state(true); },
    get source() { return source; },
  };
};

const TERMINAL = /^(Workflow(Completed|Failed|Cancelled|TimedOut|Terminated|NeedsIntervention)|ContinuedAsNew|continued)$/;
const ENDED = ["completed", "failed", "cancelled", "terminated", "timed_out", "needs_intervention", "continued_as_new"];

document.addEventListener("DOMContentLoaded", () => {
  const live = document.getElementById("live");
  if (!live || live.dataset.finished || !window.EventSource) return;
  const stale = document.getElementById("live-state");
  let pending = null;
  let stream = null;
  const refresh = () => {
    pending = null;
    htmx.ajax("GET", live.dataset.refresh, { target: "#live", swap: "innerHTML" });
  };
  const soon = () => { if (!pending) pending = setTimeout(refresh, 150); };  // coalesce bursts
  // the actions follow the run too: each refresh carries them (a <template>), taken only
  // when they differ from those shown, so what an operator is typing is kept meanwhile
  const actions = document.getElementById("actions");
  let shownActions = null;
  const takeActions = () => {
    const next = live.querySelector("template#actions-next");
    if (!actions || !next) return;
    if (shownActions !== null && next.innerHTML !== shownActions) {
      actions.innerHTML = next.innerHTML;
    }
    shownActions = next.innerHTML;
  };
  takeActions();  // what the page was rendered with
  // the refreshed fragment says the run ended (whatever event told it): nothing more comes
  live.addEventListener("htmx:afterSwap", () => {
    takeActions();
    const status = document.getElementById("status");
    if (stream && status && ENDED.includes(status.textContent.trim())) stream.close();
  });
  stream = follow(live.dataset.events, (isLive) => {
    if (stale) stale.hidden = isLive;
    live.classList.toggle("stale", !isLive);
    if (isLive) soon();  // what happened while the page was not live
  }, (source, seen) => {
    const onEvent = (e) => {
      seen(e);
      if (e.type === "token") return;
      soon();
      if (TERMINAL.test(e.type)) stream.close();
    };
    for (const type of ["WorkflowStarted", "ActivityScheduled", "ActivityCompleted", "ActivityFailed",
      "ActivityAttemptFailed", "TimerStarted", "TimerFired", "SignalReceived", "StatusSet", "Marker",
      "ChildStarted", "ChildCompleted", "ChildFailed", "WorkflowCompleted", "WorkflowFailed",
      "WorkflowCancelled", "WorkflowTimedOut", "WorkflowTerminated", "WorkflowNeedsIntervention",
      "Suspended", "Resumed", "CancelRequested", "WorkflowTaskCompleted", "RunRetried",
      "ContinuedAsNew", "continued"]) {
      source.addEventListener(type, onEvent);
    }
  }, soon);
  live.stream = stream;  // (tests look at it)
});

document.addEventListener("DOMContentLoaded", () => {
  const list = document.getElementById("runs");
  if (!list || !list.dataset.changes || !window.EventSource) return;
  follow(list.dataset.changes, (isLive) => {
    if (isLive) htmx.trigger(list, "tether-changed");  // what changed while it was not live
  }, (source) => {
    source.addEventListener("changed", () => htmx.trigger(list, "tether-changed"));
    list.changes = source;  // (tests wait until it is open)
  }, () => htmx.trigger(list, "tether-changed"));
});
