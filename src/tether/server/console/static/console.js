// tether console: confirmations for actions, a run page that refreshes itself when
// its event stream reports a new event (no polling of finished runs), and a runs list
// that refreshes when the changes stream says a run it may show changed.
document.addEventListener("submit", (ev) => {
  const question = ev.target.getAttribute("data-confirm");
  if (question && !window.confirm(question)) ev.preventDefault();
});

document.addEventListener("DOMContentLoaded", () => {
  const live = document.getElementById("live");
  if (!live || live.dataset.finished || !window.EventSource) return;
  const source = new EventSource(live.dataset.events);
  let pending = null;
  const refresh = () => {
    pending = null;
    htmx.ajax("GET", live.dataset.refresh, { target: "#live", swap: "innerHTML" });
  };
  source.onmessage = source.onerror = null;
  source.addEventListener("error", () => source.close());
  const onEvent = (e) => {
    if (e.type === "token") return;
    if (!pending) pending = setTimeout(refresh, 150);  // coalesce bursts of events
    if (/^Workflow(Completed|Failed|Cancelled|TimedOut|Terminated|NeedsIntervention)$/.test(e.type)) {
      source.close();
    }
  };
  for (const type of ["WorkflowStarted", "ActivityScheduled", "ActivityCompleted", "ActivityFailed",
    "ActivityAttemptFailed", "TimerStarted", "TimerFired", "SignalReceived", "StatusSet", "Marker",
    "ChildStarted", "ChildCompleted", "ChildFailed", "WorkflowCompleted", "WorkflowFailed",
    "WorkflowCancelled", "WorkflowTimedOut", "WorkflowTerminated", "WorkflowNeedsIntervention",
    "Suspended", "Resumed", "CancelRequested", "WorkflowTaskCompleted"]) {
    source.addEventListener(type, onEvent);
  }
});

document.addEventListener("DOMContentLoaded", () => {
  const list = document.getElementById("runs");
  if (!list || !list.dataset.changes || !window.EventSource) return;
  const source = new EventSource(list.dataset.changes);
  source.addEventListener("changed", () => htmx.trigger(list, "tether-changed"));
  list.changes = source;  // (tests wait until it is open)
});
