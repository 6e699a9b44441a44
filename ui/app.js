// Raahi dashboard: sign-in, the live event stream, an overview of every service, a page per
// service and a page of HTTP routes. Plain JavaScript (an ES module), no build step, nothing
// fetched from elsewhere.
//
// The token is kept in sessionStorage only and travels in the Authorization header; the event
// stream is read with fetch() for that reason (EventSource cannot send headers). Every event is
// applied as an upsert of full objects, so applying one twice is harmless. Routes are not in the
// stream's snapshot and their events carry no object: the list is read from the API when a page
// that shows routes opens, and again whenever a route event (or a fresh snapshot) arrives.
// A route's limits live on its own read (`routes/{id}/rate-limit`), refreshed with the routes,
// with a service page's runtime and whenever the stream says a limit tripped or cleared.
// A service's retries come with its runtime: the rate is the change in retries sent between
// two reads, over the time between them.
// A route's canary (TRAFFIC.md §4) is read from `routes/{id}/canary` while the routes page
// shows it: again on every `canary` event for that route, and every 2 s while it progresses
// and the page is visible (the interval's counts change with no event).

const API = new URL('../api/v1/', document.baseURI);
const TOKEN_KEY = 'raahi.token';
const BACKOFF_FIRST_MS = 1000;
const BACKOFF_MAX_MS = 10000;
// The server sends a comment every 15 s: a stream silent for this long is dead.
const STREAM_SILENCE_MS = 45000;
const RUNTIME_POLL_MS = 2000;
// Reads of a service's retries further apart than this give no rate (the page was elsewhere).
const RETRY_RATE_GAP_MS = 10000;
const ACTIVITY_MAX = 40;
const HISTORY_MAX = 50;
// Routes read per request (the API's largest page); more pages follow `next`.
const ROUTES_PAGE = 1000;
// How often the view of a progressing canary on screen is read again.
const CANARY_POLL_MS = 2000;

const state = {
  token: null,
  session: null, // {role, name}
  services: new Map(),
  targets: new Map(),
  sources: new Map(),
  routes: emptyRoutes(), // HTTP routes, read from the API (not part of the event stream)
  revealRoute: null, // a route id to scroll into view once its row is drawn
  // Route id -> {view (what the gateway counts), refusing: {rate_limit, max_in_flight}}.
  limits: new Map(),
  limitsApi: true, // false once `routes/{id}/rate-limit` answered 404: read /metrics instead
  // Service id -> {view (the runtime's `retries`), sent (their sum), at (ms), rate (per s)}.
  retries: new Map(),
  // Service id -> the runtime's `locality` (the zone split in force and why), from polls and
  // `locality` events.
  localities: new Map(),
  // Route id -> {view (`routes/{id}/canary`), error, loading, again, at (ms of the last read)}.
  canaries: new Map(),
  limitsLoad: { running: false, again: false, at: 0 },
  loaded: false, // a snapshot has arrived
  lastId: null,
  stream: { state: 'idle', detail: '', retryAt: 0 },
  activity: [], // recent events, newest first
  history: new Map(), // target id -> {items, loading, error}
  openTarget: null, // the target whose history is shown
  revealHistory: false,
  errors: new Map(), // action key -> message
  busy: new Set(), // action keys in flight
  generation: 0, // bumped on sign-out: stale loops stop
  // The legend starts folded on a phone's width.
  legendOpen: window.matchMedia('(min-width: 641px)').matches,
};

function emptyRoutes() {
  return { items: [], loaded: false, loading: false, again: false, error: '' };
}

// ---------------------------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------------------------

/** Builds an element; children are nodes or text (never parsed as HTML). */
// An address breaks only where its own separators are (after a `.`, `:` or `]`), and only when
// it is wider than its column: never `127.0.0.1:356` / `91`, never over the next column.
function breakableAddress(address) {
  return address.split(/(?<=[.:\]])/).flatMap((part, i) => (i === 0 ? [part] : [h('wbr'), part]));
}

function h(tag, props, ...children) {
  const el = document.createElement(tag);
  if (props) {
    for (const [key, value] of Object.entries(props)) {
      if (value === null || value === undefined || value === false) continue;
      if (key === 'class') el.className = value;
      else if (key.startsWith('on') && typeof value === 'function') {
        el.addEventListener(key.slice(2), value);
      } else el.setAttribute(key, value === true ? '' : String(value));
    }
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : String(child));
  }
  return el;
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

const timeFormat = new Intl.DateTimeFormat(undefined, {
  hour: '2-digit', minute: '2-digit', second: '2-digit',
});
const dateTimeFormat = new Intl.DateTimeFormat(undefined, {
  month: 'short', day: 'numeric', hour: '2-digit', minute: '2-digit', second: '2-digit',
});

function formatTime(iso) {
  if (!iso) return '—';
  const date = new Date(iso);
  if (Number.isNaN(date.getTime())) return String(iso);
  const today = new Date();
  return date.toDateString() === today.toDateString()
    ? timeFormat.format(date) : dateTimeFormat.format(date);
}

function spanText(ms) {
  if (Math.abs(ms) < 1000) return `${Math.round(Math.abs(ms))} ms`;
  const s = Math.round(Math.abs(ms) / 1000);
  if (s < 60) return `${s} s`;
  const m = Math.round(s / 60);
  if (m < 60) return `${m} min`;
  const hours = Math.round(m / 60);
  if (hours < 48) return `${hours} h`;
  return `${Math.round(hours / 24)} d`;
}

function relativeText(iso, now = Date.now()) {
  const ms = new Date(iso).getTime() - now;
  if (Math.abs(ms) < 1000) return 'now';
  return ms > 0 ? `in ${spanText(ms)}` : `${spanText(ms)} ago`;
}

/** A time shown relative to now (kept current by the ticker), the absolute time on hover. */
function relTime(iso) {
  if (!iso) return '—';
  return h('time', { datetime: iso, title: new Date(iso).toString(), 'data-rel': '' },
    relativeText(iso));
}

function absTime(iso) {
  if (!iso) return '—';
  return h('time', { datetime: iso, title: new Date(iso).toString() }, formatTime(iso));
}

function address(target) {
  const host = String(target.host ?? '');
  return host.includes(':') ? `[${host}]:${target.port}` : `${host}:${target.port}`;
}

function plural(n, one, many = `${one}s`) {
  return `${n} ${n === 1 ? one : many}`;
}

function byName(a, b) {
  return String(a.name).localeCompare(String(b.name)) || a.id - b.id;
}

function byTierThenAddress(a, b) {
  return (a.priority - b.priority) || address(a).localeCompare(address(b), undefined,
    { numeric: true }) || a.id - b.id;
}

// ---------------------------------------------------------------------------------------------
// Target conditions: one word per target for colour, legend and tests
// ---------------------------------------------------------------------------------------------

const CONDITIONS = [
  ['healthy', 'Healthy', 'active and passing its checks'],
  ['unknown', 'Unknown', 'active, no health verdict (not checked, or not yet)'],
  ['unhealthy', 'Unhealthy', 'failing its health checks'],
  ['ejected', 'Ejected', 'taken out after failed requests, until its ejection ends'],
  ['half-open', 'Half-open', 'ejection ended; one trial request at a time'],
  ['draining', 'Draining', 'gone from discovery; no new traffic, requests finish'],
  ['stale', 'Stale', 'its source is stale; no new traffic'],
  ['disabled', 'Disabled', 'disabled by an operator'],
];
const CONDITION_LABEL = Object.fromEntries(CONDITIONS.map(([key, label]) => [key, label]));

function isEjected(target, now = Date.now()) {
  return Boolean(target.ejected_until) && new Date(target.ejected_until).getTime() > now;
}

function condition(target, now = Date.now()) {
  if (target.state === 'draining') return 'draining';
  if (target.state === 'stale') return 'stale';
  if (!target.enabled) return 'disabled';
  if (target.health === 'unhealthy') return 'unhealthy';
  if (isEjected(target, now)) return 'ejected';
  if (target.half_open) return 'half-open';
  if (target.health === 'healthy') return 'healthy';
  return 'unknown';
}

/** DESIGN §5: active, enabled, not unhealthy, not ejected, weight above zero. */
function isAvailable(target, now = Date.now()) {
  return target.state === 'active' && target.enabled && target.health !== 'unhealthy'
    && !isEjected(target, now) && target.weight > 0;
}

function describeTarget(target, now = Date.now()) {
  const parts = [target.state, target.health];
  if (!target.enabled) parts.push('disabled');
  if (isEjected(target, now)) parts.push(`ejected until ${formatTime(target.ejected_until)}`);
  if (target.half_open) parts.push('half-open');
  return `${address(target)}: ${parts.join(', ')}`;
}

function legend() {
  return h('details', { class: 'legend', open: state.legendOpen },
    h('summary', null, 'Legend'),
    h('ul', { class: 'legend-items' },
      CONDITIONS.map(([key, label, hint]) => h('li', { title: hint },
        h('span', { class: `block c-${key}`, 'aria-hidden': 'true' }),
        h('span', null, label)))));
}

// ---------------------------------------------------------------------------------------------
// API calls
// ---------------------------------------------------------------------------------------------

class SignedOut extends Error {}

function errorMessage(status, data) {
  const error = data && typeof data === 'object' ? data.error : null;
  if (error && error.message) return `${error.message} (HTTP ${status})`;
  if (typeof data === 'string' && data) return `${data} (HTTP ${status})`;
  return `the gateway answered HTTP ${status}`;
}

async function api(method, path, body) {
  const headers = { Authorization: `Bearer ${state.token}`, Accept: 'application/json' };
  if (body !== undefined) headers['Content-Type'] = 'application/json';
  const response = await fetch(new URL(path, API), {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
    cache: 'no-store',
  });
  const text = await response.text();
  let data = null;
  if (text) {
    try { data = JSON.parse(text); } catch { data = text; }
  }
  if (response.status === 401) {
    signOut('The gateway no longer accepts this token. Sign in again.');
    throw new SignedOut();
  }
  return { status: response.status, ok: response.ok, data };
}

async function checkToken(token) {
  const response = await fetch(new URL('session', API), {
    headers: { Authorization: `Bearer ${token}`, Accept: 'application/json' },
    cache: 'no-store',
  });
  if (response.status === 401) return null;
  if (!response.ok) throw new Error(`the gateway answered HTTP ${response.status}`);
  return response.json();
}

/** Runs an admin action; its error (if any) is shown next to the control under `key`. */
async function act(key, method, path, body, onSuccess) {
  if (state.busy.has(key)) return;
  state.busy.add(key);
  state.errors.delete(key);
  scheduleRender();
  try {
    const answer = await api(method, path, body);
    if (answer.ok) {
      if (onSuccess) onSuccess(answer.data);
    } else {
      state.errors.set(key, errorMessage(answer.status, answer.data));
    }
  } catch (error) {
    if (error instanceof SignedOut) return;
    state.errors.set(key, `Cannot reach the gateway: ${error.message}`);
  } finally {
    state.busy.delete(key);
    scheduleRender();
  }
}

// ---------------------------------------------------------------------------------------------
// The event stream
// ---------------------------------------------------------------------------------------------

/** A Server-Sent Events parser (the WHATWG rules for lines, fields and dispatch). */
class SseParser {
  constructor(onEvent, onComment) {
    this.onEvent = onEvent;
    this.onComment = onComment;
    this.buffer = '';
    this.data = [];
    this.type = '';
    this.id = null;
  }

  push(text) {
    this.buffer += text;
    let start = 0;
    for (;;) {
      const lf = this.buffer.indexOf('\n', start);
      const cr = this.buffer.indexOf('\r', start);
      let end;
      let next;
      if (lf === -1 && cr === -1) break;
      if (cr === -1 || (lf !== -1 && lf < cr)) {
        end = lf;
        next = lf + 1;
      } else {
        // A CR at the very end may be the first half of CRLF: wait for more.
        if (cr === this.buffer.length - 1) break;
        end = cr;
        next = this.buffer[cr + 1] === '\n' ? cr + 2 : cr + 1;
      }
      this.line(this.buffer.slice(start, end));
      start = next;
    }
    this.buffer = this.buffer.slice(start);
  }

  line(line) {
    if (line === '') {
      this.dispatch();
      return;
    }
    if (line.startsWith(':')) {
      this.onComment(line.slice(1).trim());
      return;
    }
    const colon = line.indexOf(':');
    const field = colon === -1 ? line : line.slice(0, colon);
    let value = colon === -1 ? '' : line.slice(colon + 1);
    if (value.startsWith(' ')) value = value.slice(1);
    if (field === 'event') this.type = value;
    else if (field === 'data') this.data.push(value);
    else if (field === 'id' && !value.includes('\0')) this.id = value;
  }

  dispatch() {
    if (this.data.length > 0) {
      this.onEvent({ type: this.type || 'message', data: this.data.join('\n'), id: this.id });
    }
    this.data = [];
    this.type = '';
  }
}

let streamAbort = null;
let wakeStream = null;

function setStream(next, detail = '', retryAt = 0) {
  state.stream = { state: next, detail, retryAt };
  document.body.setAttribute('data-stream', next);
  renderStreamStatus();
}

async function streamLoop(generation) {
  let backoff = BACKOFF_FIRST_MS;
  while (generation === state.generation) {
    const controller = new AbortController();
    streamAbort = controller;
    let silence = null;
    const feed = () => {
      clearTimeout(silence);
      silence = setTimeout(() => controller.abort(new Error('no data for 45 s')),
        STREAM_SILENCE_MS);
    };
    let why = 'the stream ended';
    try {
      if (state.stream.state !== 'down') setStream('connecting');
      const headers = { Authorization: `Bearer ${state.token}`, Accept: 'text/event-stream' };
      if (state.lastId !== null) headers['Last-Event-ID'] = state.lastId;
      feed();
      // Resuming is always safe: an id from before a restart (or from another instance) gets a
      // fresh snapshot, as ids start above the process's start time.
      const response = await fetch(new URL('events', API), {
        headers, cache: 'no-store', signal: controller.signal,
      });
      if (generation !== state.generation) return;
      if (response.status === 401) {
        signOut('The gateway no longer accepts this token. Sign in again.');
        return;
      }
      if (!response.ok || !response.body) {
        throw new Error(`the gateway answered HTTP ${response.status}`);
      }
      setStream('live');
      backoff = BACKOFF_FIRST_MS;
      const parser = new SseParser((event) => {
        if (generation === state.generation) onStreamEvent(event);
      }, () => {});
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        feed();
        parser.push(value);
      }
    } catch (error) {
      if (generation !== state.generation) return;
      const reason = controller.signal.reason instanceof Error ? controller.signal.reason : error;
      why = reason && reason.message ? reason.message : String(reason);
      if (why === 'Failed to fetch' || why.startsWith('network error')) {
        why = 'the gateway cannot be reached';
      }
    } finally {
      clearTimeout(silence);
    }
    if (generation !== state.generation) return;
    setStream('down', why, Date.now() + backoff);
    await new Promise((resolve) => {
      const timer = setTimeout(resolve, backoff);
      wakeStream = () => { clearTimeout(timer); resolve(); };
    });
    wakeStream = null;
    backoff = Math.min(backoff * 2, BACKOFF_MAX_MS);
  }
}

function onStreamEvent(event) {
  let payload;
  try {
    payload = JSON.parse(event.data);
  } catch {
    console.warn('raahi: an event whose data is not JSON', event);
    return;
  }
  if (event.id !== null && event.id !== '') state.lastId = event.id;
  switch (event.type) {
    case 'snapshot': applySnapshot(payload); break;
    case 'target': applyTarget(payload); break;
    case 'source': applySource(payload); break;
    case 'config': applyConfig(payload); break;
    case 'route': applyRoute(payload); break;
    case 'locality': applyLocality(payload); break;
    case 'canary': applyCanary(payload); break;
    default: return;
  }
  scheduleRender();
}

function applySnapshot(snapshot) {
  state.services = new Map((snapshot.services ?? []).map((s) => [s.id, s]));
  state.targets = new Map((snapshot.targets ?? []).map((t) => [t.id, t]));
  state.sources = new Map((snapshot.sources ?? []).map((s) => [s.id, s]));
  state.loaded = true;
  // Events may have been missed: histories on screen are read again.
  const open = state.openTarget;
  state.history.clear();
  if (open !== null) loadHistory(open);
  // Route events may have been missed too (limits tripping or clearing among them), and the
  // gateway may be another version.
  for (const entry of state.limits.values()) entry.refusing = {};
  state.limitsApi = true;
  if (routesShown()) loadRoutes();
}

function remember(entry) {
  state.activity.unshift(entry);
  if (state.activity.length > ACTIVITY_MAX) state.activity.length = ACTIVITY_MAX;
}

function applyTarget(event) {
  if (event.target) state.targets.set(event.target.id, event.target);
  else state.targets.delete(event.target_id);
  const history = state.history.get(event.target_id);
  if (history) {
    const entry = {
      id: event.id, at: event.at, change: event.change, from: event.from, to: event.to,
      reason: event.reason,
    };
    history.items = mergeHistory(history.items, [entry]);
  }
  remember({
    id: event.id,
    at: event.at,
    service_id: event.service_id,
    target_id: event.target_id,
    subject: event.address,
    what: changeText(event),
    reason: event.reason,
    tone: toneOf(event.to ?? event.change),
  });
}

function applySource(event) {
  const known = state.sources.get(event.source_id);
  state.sources.set(event.source_id, known ? { ...known, status: event.status } : {
    id: event.source_id, service_id: event.service_id, name: event.name, provider: '',
    enabled: true, status: event.status,
  });
  remember({
    id: event.id,
    at: event.at,
    service_id: event.service_id,
    what: `source ${event.name} ${changeText(event)}`,
    reason: event.reason,
    tone: toneOf(event.to ?? event.change),
  });
}

function applyConfig(event) {
  if (event.kind === 'service') {
    if (event.change === 'deleted') {
      state.services.delete(event.object_id);
      for (const [id, t] of state.targets) if (t.service_id === event.object_id) state.targets.delete(id);
      for (const [id, s] of state.sources) if (s.service_id === event.object_id) state.sources.delete(id);
    } else if (event.object) {
      const known = state.services.get(event.object.id);
      state.services.set(event.object.id, {
        ...event.object, panic_picks: event.object.panic_picks ?? known?.panic_picks ?? 0,
      });
    }
  } else if (event.kind === 'discovery_source') {
    if (event.change === 'deleted') state.sources.delete(event.object_id);
    else if (event.object) {
      const known = state.sources.get(event.object.id);
      state.sources.set(event.object.id, { ...event.object, status: event.object.status ?? known?.status });
    }
  } else if (event.kind === 'route') {
    // A route event names the route but carries no object: read the list again (also when no
    // page shows it now, so that the list kept for later is not out of date).
    if (routesShown() || state.routes.loaded) loadRoutes();
  }
  const kind = event.kind.replace('_', ' ');
  remember({
    id: event.id,
    at: event.at,
    kind: event.kind,
    service_id: event.service_id,
    what: `${kind}${event.name ? ` ${event.name}` : ` ${event.object_id}`} ${event.change}`,
    reason: '',
    tone: event.change === 'deleted' ? 'muted' : 'info',
  });
}

/** A route's limit tripped (started refusing) or cleared (refused none for 10 s). */
function applyRoute(event) {
  const entry = limitEntry(event.route_id);
  const tripped = event.change === 'tripped';
  entry.refusing = { ...entry.refusing, [event.limit]: tripped };
  // The count the event carries is news until the next read.
  const field = event.limit === 'rate_limit' ? 'rate_limited_total' : 'in_flight_refused';
  entry.view = { ...(entry.view ?? {}), [field]: Math.max(entry.view?.[field] ?? 0, event.refused_total ?? 0) };
  remember({
    id: event.id,
    at: event.at,
    kind: 'route',
    service_id: event.service_id,
    what: `route ${event.name} ${event.limit} ${tripped ? 'refusing' : 'cleared'}`,
    reason: event.reason,
    tone: tripped ? 'bad' : 'good',
  });
  if (routesShown()) loadLimits();
}

/** A service's zone split changed (TRAFFIC.md §4): to the zone only, or to every zone. */
function applyLocality(event) {
  const known = state.localities.get(event.service_id);
  state.localities.set(event.service_id, {
    ...(known ?? {}), zone: event.zone, in_force: event.to, basis: event.basis,
    available: event.available, total: event.total,
    min_available_percent: event.min_available_percent, reason: event.reason,
  });
  remember({
    id: event.id,
    at: event.at,
    kind: 'locality',
    service_id: event.service_id,
    what: `service ${event.name} ${event.to === 'zone_only' ? `in zone ${event.zone} only` : 'over every zone'}`,
    reason: event.reason,
    tone: event.to === 'zone_only' ? 'good' : 'warn',
  });
}

/**
 * A route's canary moved: a step, a hold, a rollback, a promotion, an operator's action or a
 * new canary. The route's status is updated at once (its backends' shares follow it) and the
 * canary's view is read again where it is shown. A hold (a new interval at the same weight)
 * is left out of the recent changes: it comes every interval.
 */
function applyCanary(event) {
  const route = state.routes.items.find((r) => r.id === event.route_id);
  const before = route?.canary_status ?? null;
  if (route && (!before || before.round <= event.round)) {
    route.canary_status = {
      ...(before ?? {}), state: event.state, step: event.step, weight: event.weight,
      round: event.round, reason: event.reason,
    };
  }
  const held = event.state === 'progressing' && event.previous_weight === event.weight
    && (before === null || before.state === 'progressing');
  if (!held) {
    remember({
      id: event.id,
      at: event.at,
      kind: 'canary',
      service_id: event.service_id,
      what: `route ${event.name} canary ${canaryMoveText(event)}`,
      reason: event.reason,
      tone: canaryTone(event.state),
    });
  }
  if (canaryRoutesShown().some((r) => r.id === event.route_id)) loadCanary(event.route_id);
}

function canaryMoveText(event) {
  const from = event.previous_weight;
  switch (event.state) {
    case 'rolled_back': return from === null ? 'rolled back: 0 %' : `rolled back: ${from} → 0 %`;
    case 'promoted': return from === null ? 'promoted: 100 %' : `promoted: ${from} → 100 %`;
    case 'paused': return `paused at ${event.weight} %`;
    default:
      if (from === null || from === undefined) return `started at ${event.weight} %`;
      return from === event.weight ? `resumed at ${event.weight} %` : `${from} → ${event.weight} %`;
  }
}

function canaryTone(word) {
  switch (word) {
    case 'promoted': return 'good';
    case 'rolled_back': return 'bad';
    case 'paused': return 'warn';
    default: return 'info';
  }
}

function changeText(event) {
  // An ejection's `to` is when it ends; a revision's is an opaque token.
  if (event.change === 'ejected') return event.to ? `ejected until ${formatTime(event.to)}` : 'ejected';
  if (event.change === 'revision') return 'new answer';
  if (event.change === 'half_open') return 'half-open';
  if (event.from && event.to) return `${event.change}: ${event.from} → ${event.to}`;
  if (event.to) return `${event.change}: ${event.to}`;
  return event.change;
}

function toneOf(word) {
  switch (word) {
    case 'healthy': case 'active': case 'added': case 'restored': case 'enabled': return 'good';
    case 'unhealthy': case 'failing': case 'stale': case 'removed': case 'ejected': return 'bad';
    case 'draining': case 'half_open': case 'disabled': case 'guard': case 'pending': return 'warn';
    default: return 'info';
  }
}

function mergeHistory(items, more) {
  const byId = new Map();
  for (const item of [...items, ...more]) byId.set(item.id, item);
  return [...byId.values()].sort((a, b) => b.id - a.id).slice(0, HISTORY_MAX);
}

async function loadHistory(id) {
  const known = state.history.get(id);
  state.history.set(id, { items: known?.items ?? [], loading: true, error: '' });
  scheduleRender();
  try {
    const answer = await api('GET', `targets/${id}/history`);
    const entry = state.history.get(id) ?? { items: [] };
    if (answer.ok) {
      entry.items = mergeHistory(entry.items, answer.data.items ?? []);
      entry.error = '';
    } else if (answer.status === 404) {
      entry.error = '';
    } else {
      entry.error = errorMessage(answer.status, answer.data);
    }
    entry.loading = false;
    state.history.set(id, entry);
  } catch (error) {
    if (error instanceof SignedOut) return;
    state.history.set(id, { items: known?.items ?? [], loading: false,
      error: `Cannot reach the gateway: ${error.message}` });
  }
  scheduleRender();
}

function toggleHistory(id) {
  if (state.openTarget === id) {
    state.openTarget = null;
  } else {
    state.openTarget = id;
    state.revealHistory = true;
    loadHistory(id);
  }
  scheduleRender();
}

// ---------------------------------------------------------------------------------------------
// HTTP routes: read from the API, as the event stream carries no route objects
// ---------------------------------------------------------------------------------------------

/** Whether the page on screen shows routes (the routes page, or a service's routes). */
function routesShown() {
  if (!state.session) return false;
  const name = currentRoute().name;
  return name === 'routes' || name === 'service';
}

/**
 * Reads every route (following `next` past the first page). Calls made while a read is under
 * way are folded into one more read after it, so a burst of events costs at most two.
 */
async function loadRoutes() {
  const routes = state.routes;
  if (routes.loading) {
    routes.again = true;
    return;
  }
  routes.loading = true;
  const generation = state.generation;
  scheduleRender();
  try {
    do {
      routes.again = false;
      const items = [];
      let after = null;
      let failure = '';
      for (;;) {
        const query = after === null ? '' : `&after=${encodeURIComponent(after)}`;
        const answer = await api('GET', `routes?limit=${ROUTES_PAGE}${query}`);
        if (generation !== state.generation) return;
        if (!answer.ok) {
          failure = `Cannot read the routes: ${errorMessage(answer.status, answer.data)}`;
          break;
        }
        items.push(...(answer.data?.items ?? []));
        const next = answer.data?.next ?? null;
        if (next === null || (after !== null && next <= after)) break;
        after = next;
      }
      if (failure) {
        routes.error = failure;
      } else {
        keepNewerCanaryStatus(routes.items, items);
        routes.items = items;
        routes.loaded = true;
        routes.error = '';
      }
    } while (routes.again);
    loadLimits();
    loadCanaries();
  } catch (error) {
    if (error instanceof SignedOut || generation !== state.generation) return;
    routes.error = `Cannot reach the gateway: ${error.message}`;
  } finally {
    if (generation === state.generation) {
      routes.loading = false;
      scheduleRender();
    }
  }
}

/** Reads the routes when the page opened shows them. */
function syncRoutes() {
  if (routesShown()) loadRoutes();
}

// ---------------------------------------------------------------------------------------------
// Route limits (TRAFFIC.md §6): a rate limit and max_in_flight, with their refusals
// ---------------------------------------------------------------------------------------------

function hasLimits(route) {
  return Boolean(route.rate_limit) || (route.max_in_flight !== null && route.max_in_flight !== undefined);
}

/** Whether `route` sends requests to service `id`, as a backend or a mirror. */
function sendsTo(route, id) {
  return (route.backends ?? []).some((b) => b.service_id === id)
    || Boolean(route.mirror && route.mirror.service_id === id);
}

/** The routes with a limit on the page now: every one on the routes page, a service's own. */
function limitedRoutesShown() {
  if (!state.session || !state.routes.loaded) return [];
  const page = currentRoute();
  if (page.name === 'routes') return state.routes.items.filter(hasLimits);
  if (page.name === 'service') {
    return state.routes.items.filter((r) => hasLimits(r) && sendsTo(r, page.service));
  }
  return [];
}

function limitEntry(id) {
  let entry = state.limits.get(id);
  if (!entry) {
    entry = { view: null, refusing: {}, from: '', error: '' };
    state.limits.set(id, entry);
  }
  return entry;
}

/**
 * Reads what the gateway counts for each limited route on the page. Calls made while a read
 * is under way are folded into one more read after it. A gateway without the rate-limit
 * endpoint (404) is read through /metrics instead, which has the same counters.
 */
async function loadLimits() {
  const load = state.limitsLoad;
  if (load.running) {
    load.again = true;
    return;
  }
  load.running = true;
  const generation = state.generation;
  try {
    do {
      load.again = false;
      load.at = Date.now();
      const fromMetrics = [];
      for (const route of limitedRoutesShown()) {
        if (!state.limitsApi) {
          fromMetrics.push(route);
          continue;
        }
        const answer = await api('GET', `routes/${route.id}/rate-limit`);
        if (generation !== state.generation) return;
        const entry = limitEntry(route.id);
        if (answer.ok && answer.data && typeof answer.data === 'object') {
          entry.view = answer.data;
          entry.from = 'api';
          entry.error = '';
        } else if (answer.status === 404 && endpointMissing(answer.data)) {
          state.limitsApi = false;
          fromMetrics.push(route);
        } else if (answer.status === 404) {
          // The route is gone; the route event on its way reads the list again.
          entry.error = '';
        } else {
          entry.error = `Cannot read its limits: ${errorMessage(answer.status, answer.data)}`;
        }
      }
      if (fromMetrics.length) await limitsFromMetrics(fromMetrics, generation);
      if (generation !== state.generation) return;
      scheduleRender();
    } while (load.again);
  } catch (error) {
    if (error instanceof SignedOut || generation !== state.generation) return;
  } finally {
    if (generation === state.generation) load.running = false;
  }
}

/** Whether a 404 is the admin API's own "no such resource" (a gateway without the endpoint). */
function endpointMissing(data) {
  const message = data && typeof data === 'object' ? data.error?.message ?? '' : '';
  return message.startsWith('no such admin resource');
}

/** A label value as the Prometheus text format writes it. */
function metricLabel(value) {
  return String(value).replace(/\\/g, '\\\\').replace(/"/g, '\\"').replace(/\n/g, '\\n');
}

/** Each series of a Prometheus text (`name{labels}` → value). */
function parseMetrics(text) {
  const series = new Map();
  for (const line of text.split('\n')) {
    if (!line || line.startsWith('#')) continue;
    const space = line.lastIndexOf(' ');
    if (space > 0) series.set(line.slice(0, space), Number(line.slice(space + 1)));
  }
  return series;
}

async function limitsFromMetrics(routes, generation) {
  let text;
  try {
    const response = await fetch(new URL('../../metrics', API), { cache: 'no-store' });
    if (!response.ok) return;
    text = await response.text();
  } catch {
    return;
  }
  if (generation !== state.generation) return;
  const series = parseMetrics(text);
  for (const route of routes) {
    const label = `{route="${metricLabel(route.name)}"}`;
    const read = (name) => series.get(`${name}${label}`) ?? null;
    const entry = limitEntry(route.id);
    entry.view = {
      route_id: route.id,
      route: route.name,
      keys: read('raahi_rate_limit_keys'),
      rate_limited_total: read('raahi_rate_limited_total'),
      max_in_flight: route.max_in_flight ?? null,
      in_flight: read('raahi_route_in_flight'),
      in_flight_refused: read('raahi_route_in_flight_refused_total'),
      cluster: null,
    };
    entry.from = 'metrics';
    entry.error = '';
  }
}

/** Refreshes the limits on the page while one of them refuses (no event says how many). */
function pollRefusingLimits(now) {
  if (state.stream.state !== 'live' || now - state.limitsLoad.at < RUNTIME_POLL_MS) return;
  if (limitedRoutesShown().some((r) => Object.values(state.limits.get(r.id)?.refusing ?? {})
    .some(Boolean))) {
    loadLimits();
  }
}

/** `5/s`, `0.5/s`, `1.667/s`. */
function rateText(perSecond) {
  return `${Math.round(Number(perSecond) * 1000) / 1000}/s`;
}

function rateKeyText(key) {
  if (!key || key === 'client_ip') return 'per client IP';
  if (key === 'route') return 'for the whole route';
  if (key.header) return `per header ${key.header}`;
  return String(key);
}

// A rate limit as TRAFFIC.md §6 words it: "5/s per client IP, burst 10, shared by the cluster".
function rateLimitText(limit) {
  const burst = limit.burst ?? Math.max(1, Math.ceil(Number(limit.requests_per_second)));
  const scope = limit.scope === 'cluster' ? ', shared by the cluster' : '';
  return `${rateText(limit.requests_per_second)} ${rateKeyText(limit.key)}, burst ${burst}${scope}`;
}

function inFlightText(route) {
  return `at most ${route.max_in_flight} in flight`;
}

function countText(value) {
  return value === null || value === undefined ? '—' : String(value);
}

/** One limit: what it allows, whether it refuses now, and what it refused. */
function limitLine(route, limit, text, refused, extra) {
  const entry = state.limits.get(route.id);
  const refusing = Boolean(entry?.refusing?.[limit]);
  return h('li', { class: 'limit', 'data-key': `limit-${limit}`, 'data-limit': limit,
    'data-refusing': String(refusing) },
  h('span', { class: 'limit-head' },
    badge(refusing ? 'refusing' : 'limit', limit === 'rate_limit' ? 'rate' : 'in flight',
      { title: refusing ? 'Refusing requests now' : null }),
    ' ', h('span', { 'data-testid': `route-${limit.replace(/_/g, '-')}-${route.id}` }, text)),
  h('span', { class: 'muted small limit-counts' }, 'refused ',
    h('span', { class: 'count', 'data-testid': `route-${limit.replace(/_/g, '-')}-refused-${route.id}` },
      countText(refused)),
    extra));
}

/** A cluster-wide rate limit: this gateway's default share and the hot keys' shares. */
function clusterLines(cluster) {
  const synced = cluster.synced_at ? ['synced ', relTime(cluster.synced_at)] : 'not synced yet';
  const hot = cluster.hot_keys ?? [];
  return h('div', { class: 'limit-cluster small', 'data-testid': 'limit-cluster' },
    h('div', null, `${plural(cluster.instances ?? 1, 'gateway')} · this one's default share `,
      rateText(cluster.default_share_per_second ?? 0), ' · ', synced),
    cluster.last_error ? h('div', { class: 'warn-text' }, `Last sync failed: ${cluster.last_error}`) : null,
    hot.length ? h('ul', { class: 'hot-keys' }, hot.map((k, i) => h('li', { 'data-key': `hot-${i}` },
      h('code', null, k.key), ` wants ${rateText(k.demand_per_second)}, gets ${rateText(k.share_per_second)} here`,
      (k.gateways ?? []).length ? h('div', { class: 'muted' }, 'demand by gateway: ', k.gateways.map((g, j) =>
        [j ? ', ' : '', g.instance_id, g.instance_id === cluster.instance_id ? ' (this one)' : '',
          ' ', rateText(g.demand_per_second)])) : null))) : null);
}

/** A route's limits with their refusals on this gateway (the routes page's Limits column). */
function routeLimits(route) {
  if (!hasLimits(route)) return h('span', { class: 'muted' }, 'none');
  const entry = state.limits.get(route.id);
  const view = entry?.view ?? {};
  const lines = [];
  if (route.rate_limit) {
    const keys = view.keys !== null && view.keys !== undefined
      ? ` · ${plural(view.keys, 'key')}${view.capacity ? ` of ${view.capacity}` : ''}` : '';
    lines.push(limitLine(route, 'rate_limit', rateLimitText(route.rate_limit),
      view.rate_limited_total, [' (429)', keys]));
  }
  if (route.max_in_flight !== null && route.max_in_flight !== undefined) {
    const now = view.in_flight !== null && view.in_flight !== undefined ? ` · ${view.in_flight} now` : '';
    lines.push(limitLine(route, 'max_in_flight', inFlightText(route), view.in_flight_refused,
      [' (503)', now]));
  }
  return h('div', { class: 'limits', 'data-testid': `route-limits-${route.id}`,
    'data-from': entry?.from ?? '' },
  h('ul', { class: 'limit-list' }, lines),
  route.rate_limit && view.cluster ? clusterLines(view.cluster) : null,
  entry?.error ? h('p', { class: 'action-error', role: 'alert' }, entry.error) : null);
}

// ---------------------------------------------------------------------------------------------
// Route canaries (TRAFFIC.md §4): where each stands, the interval being judged, its history
// ---------------------------------------------------------------------------------------------

/** Keeps a route's canary status from `old` where it is newer than the one just read. */
function keepNewerCanaryStatus(old, items) {
  const known = new Map(old.filter((r) => r.canary_status).map((r) => [r.id, r.canary_status]));
  for (const route of items) {
    const before = known.get(route.id);
    if (before && route.canary_status && before.round > route.canary_status.round) {
      route.canary_status = before;
    }
  }
}

/** The canary routes whose progress the page shows in full (the routes page). */
function canaryRoutesShown() {
  if (!state.session || !state.routes.loaded || currentRoute().name !== 'routes') return [];
  return state.routes.items.filter((r) => r.canary);
}

function canaryEntry(id) {
  let entry = state.canaries.get(id);
  if (!entry) {
    entry = { view: null, error: '', loading: false, again: false, missing: false, at: 0 };
    state.canaries.set(id, entry);
  }
  return entry;
}

function loadCanaries() {
  for (const route of canaryRoutesShown()) loadCanary(route.id);
}

/**
 * Reads a route's canary view. Calls made while a read is under way are folded into one
 * more read after it.
 */
async function loadCanary(id) {
  const entry = canaryEntry(id);
  if (entry.loading) {
    entry.again = true;
    return;
  }
  entry.loading = true;
  const generation = state.generation;
  try {
    do {
      entry.again = false;
      entry.at = Date.now();
      const answer = await api('GET', `routes/${id}/canary`);
      if (generation !== state.generation) return;
      if (answer.ok && answer.data && typeof answer.data === 'object') {
        entry.view = answer.data;
        entry.error = '';
        noteCanaryView(id, answer.data);
      } else if (answer.status === 404) {
        // The canary is gone (the route event on its way reads the routes again), or the
        // gateway has no such endpoint: what the route list says is all there is.
        entry.view = null;
        entry.missing = endpointMissing(answer.data);
        entry.error = '';
      } else {
        entry.error = `Cannot read its canary: ${errorMessage(answer.status, answer.data)}`;
      }
      scheduleRender();
    } while (entry.again);
  } catch (error) {
    if (error instanceof SignedOut || generation !== state.generation) return;
    entry.error = `Cannot reach the gateway: ${error.message}`;
    scheduleRender();
  } finally {
    if (generation === state.generation) entry.loading = false;
  }
}

/** A canary view read (or answered to an action): the route's status follows it when newer. */
function noteCanaryView(id, view) {
  const route = state.routes.items.find((r) => r.id === id);
  if (!route || !view.interval) return;
  const before = route.canary_status;
  if (before && before.round > view.interval.round) return;
  route.canary_status = {
    state: view.state, step: view.step, weight: view.weight, round: view.interval.round,
    interval_started_ms: new Date(view.interval.started_at).getTime(), reason: view.reason,
  };
}

/** Where a route's canary stands: its view or the route's status, whichever is newer. */
function canaryStatusOf(route) {
  const view = state.canaries.get(route.id)?.view;
  const status = route.canary_status ?? null;
  if (view && view.interval && (!status || view.interval.round >= status.round)) {
    return { state: view.state, step: view.step, weight: view.weight, round: view.interval.round,
      reason: view.reason };
  }
  return status;
}

/**
 * Reads the progressing canaries on screen again every CANARY_POLL_MS while the page is
 * visible: the interval's counts grow with no event.
 */
function pollCanaries(now) {
  if (state.stream.state !== 'live' || document.visibilityState !== 'visible') return;
  for (const route of canaryRoutesShown()) {
    const entry = canaryEntry(route.id);
    if (!entry.missing && !entry.loading && now - entry.at >= CANARY_POLL_MS
      && canaryStatusOf(route)?.state === 'progressing') {
      loadCanary(route.id);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Runtime counters on a service page (in flight, panic picks)
// ---------------------------------------------------------------------------------------------

let pollTimer = null;
let pollService = null;

function syncPolling() {
  const id = state.session ? currentRoute().service : null;
  if (id === pollService) return;
  clearInterval(pollTimer);
  pollTimer = null;
  pollService = id;
  if (id !== null) {
    pollRuntime(id);
    pollTimer = setInterval(() => pollRuntime(id), RUNTIME_POLL_MS);
  }
}

async function pollRuntime(id) {
  if (state.stream.state !== 'live') return;
  let answer;
  try {
    answer = await api('GET', `services/${id}/runtime`);
  } catch {
    return;
  }
  if (!answer.ok || pollService !== id) return;
  loadLimits();
  let changed = false;
  const service = state.services.get(id);
  if (service && service.panic_picks !== answer.data.panic_picks) {
    state.services.set(id, { ...service, panic_picks: answer.data.panic_picks });
    changed = true;
  }
  if (answer.data.retries && updateRetries(id, answer.data.retries, Date.now())) changed = true;
  const locality = answer.data.locality;
  if (locality && JSON.stringify(state.localities.get(id)) !== JSON.stringify(locality)) {
    state.localities.set(id, locality);
    changed = true;
  }
  for (const runtime of answer.data.targets ?? []) {
    const target = state.targets.get(runtime.id);
    if (target && target.in_flight !== runtime.in_flight) {
      state.targets.set(runtime.id, { ...target, in_flight: runtime.in_flight });
      changed = true;
    }
  }
  // A refresh that changes nothing sends no event; every role may read the status itself (it
  // carries no config), so the refresh times on the page stay exact.
  for (const source of servicesSources(id)) {
    let status;
    try {
      status = await api('GET', `discovery-sources/${source.id}/status`);
    } catch {
      return;
    }
    const known = state.sources.get(source.id);
    if (status.ok && known && pollService === id
      && JSON.stringify(known.status) !== JSON.stringify(status.data)) {
      state.sources.set(source.id, { ...known, status: status.data });
      changed = true;
    }
  }
  if (changed) scheduleRender();
}

/**
 * Keeps a service's latest `retries` and its retry rate: retries sent since the read before,
 * per second. A first read, or one long after the one before (the page was elsewhere), has no
 * rate yet. Returns whether anything shown changed.
 */
function updateRetries(id, view, now) {
  const sent = Object.values(view.sent ?? {}).reduce((sum, n) => sum + Number(n), 0);
  const before = state.retries.get(id);
  let rate = null;
  if (before && now > before.at && now - before.at <= RETRY_RATE_GAP_MS) {
    // Counters start again at zero when the service is created anew: no negative rate.
    rate = Math.max(0, sent - before.sent) / ((now - before.at) / 1000);
  }
  state.retries.set(id, { view, sent, at: now, rate });
  return !before || before.rate !== rate || JSON.stringify(before.view) !== JSON.stringify(view);
}

// ---------------------------------------------------------------------------------------------
// Session
// ---------------------------------------------------------------------------------------------

function enter(token, session) {
  state.token = token;
  state.session = session;
  state.generation += 1;
  state.loaded = false;
  state.lastId = null;
  state.activity = [];
  state.history.clear();
  state.errors.clear();
  state.openTarget = null;
  state.routes = emptyRoutes();
  state.limits = new Map();
  state.retries = new Map();
  state.canaries = new Map();
  state.limitsApi = true;
  state.limitsLoad = { running: false, again: false, at: 0 };
  state.revealRoute = currentRoute().routeId;
  renderHeader();
  render();
  streamLoop(state.generation);
  syncPolling();
  syncRoutes();
}

function signOut(message = '') {
  state.generation += 1;
  if (streamAbort) streamAbort.abort(new Error('signed out'));
  sessionStorage.removeItem(TOKEN_KEY);
  state.token = null;
  state.session = null;
  state.services = new Map();
  state.targets = new Map();
  state.sources = new Map();
  state.routes = emptyRoutes();
  state.retries = new Map();
  state.canaries = new Map();
  state.revealRoute = null;
  state.loaded = false;
  state.lastId = null;
  state.activity = [];
  state.history.clear();
  state.errors.clear();
  state.openTarget = null;
  syncPolling();
  setStream('idle');
  renderHeader();
  renderSignIn(message);
}

/** A token from an earlier page load: check it, waiting out a gateway that is down. */
async function resume(token) {
  let backoff = BACKOFF_FIRST_MS;
  const generation = state.generation;
  for (;;) {
    try {
      const session = await checkToken(token);
      if (generation !== state.generation) return;
      if (session === null) {
        signOut('The gateway no longer accepts the saved token. Sign in again.');
      } else {
        enter(token, session);
      }
      return;
    } catch (error) {
      if (generation !== state.generation) return;
      setStream('down', 'the gateway cannot be reached', Date.now() + backoff);
      await sleep(backoff);
      backoff = Math.min(backoff * 2, BACKOFF_MAX_MS);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Rendering
// ---------------------------------------------------------------------------------------------

let renderTimer = null;

function scheduleRender() {
  if (renderTimer !== null) return;
  renderTimer = setTimeout(() => {
    renderTimer = null;
    render();
  }, 16);
}

function currentRoute() {
  const hash = location.hash.replace(/^#/, '') || '/';
  const service = /^\/services\/(\d+)\/?$/.exec(hash);
  if (service) return { name: 'service', service: Number(service[1]), routeId: null };
  // `#/routes/7`: the routes page with route 7 picked out.
  const routes = /^\/routes(?:\/(\d+))?\/?$/.exec(hash);
  if (routes) {
    return { name: 'routes', service: null, routeId: routes[1] ? Number(routes[1]) : null };
  }
  if (hash === '/' || hash === '') return { name: 'overview', service: null, routeId: null };
  return { name: 'unknown', service: null, routeId: null };
}

/** The key that pairs an old node with its new version while morphing (elements only). */
function keyOf(node) {
  return node.nodeType === Node.ELEMENT_NODE ? node.getAttribute('data-key') : null;
}

/**
 * Makes `from` (in the page) look like `to` (just built), keeping every node that can stay:
 * focus, scroll positions, an element under the pointer and text selections survive updates.
 * Children with a `data-key` are matched by key, the others by position. The page's behaviour
 * is attached by delegation on `main`, never to these nodes, so nothing stale is left behind.
 */
function morph(from, to) {
  if (from.nodeType !== to.nodeType || from.nodeName !== to.nodeName
    || keyOf(from) !== keyOf(to)) {
    from.replaceWith(to);
    return;
  }
  if (from.nodeType !== Node.ELEMENT_NODE) {
    if (from.nodeValue !== to.nodeValue) from.nodeValue = to.nodeValue;
    return;
  }
  for (const { name } of [...from.attributes]) {
    if (!to.hasAttribute(name)) from.removeAttribute(name);
  }
  for (const { name, value } of [...to.attributes]) {
    if (from.getAttribute(name) !== value) from.setAttribute(name, value);
  }
  morphChildren(from, to);
}

function morphChildren(from, to) {
  const wanted = [...to.childNodes];
  const keyed = new Map();
  for (const child of from.childNodes) {
    const key = keyOf(child);
    if (key !== null) keyed.set(key, child);
  }
  wanted.forEach((next, index) => {
    const current = from.childNodes[index] ?? null;
    const key = keyOf(next);
    let match = null;
    if (key !== null) {
      match = keyed.get(key) ?? null;
      keyed.delete(key);
    } else if (current && keyOf(current) === null && current.nodeName === next.nodeName) {
      match = current;
    }
    if (match === null) {
      from.insertBefore(next, current);
      return;
    }
    if (match !== current) from.insertBefore(match, current);
    morph(match, next);
  });
  while (from.childNodes.length > wanted.length) from.lastChild.remove();
}

function render() {
  if (!state.session) return;
  const main = document.getElementById('main');
  const active = document.activeElement;
  const focusKey = active && main.contains(active) ? active.getAttribute('data-focus') : null;

  const route = currentRoute();
  let view;
  if (!state.loaded) view = loadingView();
  else if (route.name === 'service') view = servicePage(route.service);
  else if (route.name === 'routes') view = routesPage(route.routeId);
  else if (route.name === 'overview') view = overviewPage();
  else view = notFoundView('There is no such page.');
  const shown = main.firstElementChild;
  if (main.childNodes.length === 1 && shown && keyOf(shown) !== null) morph(shown, view);
  else main.replaceChildren(view);

  // The focused element was replaced (e.g. the page changed): focus its new version.
  if (focusKey && !main.contains(document.activeElement)) {
    const el = main.querySelector(`[data-focus="${CSS.escape(focusKey)}"]`);
    if (el) el.focus({ preventScroll: true });
  }
  if (state.revealHistory) {
    state.revealHistory = false;
    const panel = main.querySelector('#history');
    if (panel) panel.scrollIntoView({ block: 'nearest' });
  }
  revealRouteRow();
  renderNav();
}

/** Scrolls the route picked out by `#/routes/{id}` into view, once its row is drawn. */
function revealRouteRow() {
  const id = state.revealRoute;
  if (id === null) return;
  const row = document.querySelector(`#main [data-route-id="${id}"]`);
  if (row) {
    state.revealRoute = null;
    row.scrollIntoView({ block: 'center' });
  } else if (state.routes.loaded && !state.routes.loading) {
    state.revealRoute = null; // no such route
  }
}

/** The header's links: the section shown is marked (the page itself with aria-current). */
function renderNav() {
  const nav = document.getElementById('nav');
  if (!nav) return;
  nav.hidden = !state.session;
  const page = currentRoute().name;
  for (const link of nav.querySelectorAll('a[data-section]')) {
    const section = link.getAttribute('data-section');
    const inside = section === 'routes' ? page === 'routes'
      : page === 'overview' || page === 'service';
    const here = section === 'routes' ? page === 'routes' : page === 'overview';
    link.classList.toggle('active', inside);
    if (here) link.setAttribute('aria-current', 'page');
    else link.removeAttribute('aria-current');
  }
}

function renderHeader() {
  const who = document.getElementById('who');
  const out = document.getElementById('sign-out');
  const pill = document.getElementById('live-pill');
  if (state.session) {
    who.replaceChildren(
      h('span', { class: 'who-name' }, state.session.name),
      h('span', { class: `role role-${state.session.role}` }, state.session.role));
    who.setAttribute('data-role', state.session.role);
    who.hidden = false;
    out.hidden = false;
    pill.hidden = false;
  } else {
    who.hidden = true;
    who.replaceChildren();
    out.hidden = true;
    pill.hidden = true;
  }
  renderNav();
}

function renderStreamStatus() {
  const el = document.getElementById('stream-status');
  const pill = document.getElementById('live-pill');
  const { state: now, detail, retryAt } = state.stream;
  el.setAttribute('data-state', now);
  pill.setAttribute('data-state', now);
  pill.textContent = { live: 'Live', connecting: 'Connecting…', down: 'Disconnected', idle: '' }[now];
  if (now === 'down') {
    el.replaceChildren(
      h('strong', null, 'Disconnected — reconnecting…'),
      h('span', { class: 'stream-detail' }, ` ${detail}.`),
      h('span', { class: 'stream-retry', 'aria-hidden': 'true', 'data-retry-at': String(retryAt) },
        retryText(retryAt)),
      state.session ? h('button', {
        type: 'button', class: 'btn btn-small', 'data-testid': 'reconnect-now',
        onclick: () => { if (wakeStream) wakeStream(); },
      }, 'Retry now') : null);
  } else if (now === 'connecting') {
    el.replaceChildren(h('span', null, 'Connecting to the live event stream…'));
  } else if (now === 'live') {
    el.replaceChildren(h('span', { class: 'sr-only' }, 'Live: receiving updates from the gateway.'));
  } else {
    el.replaceChildren();
  }
}

function retryText(retryAt) {
  const left = Math.max(0, retryAt - Date.now());
  return left > 500 ? ` Next attempt in ${Math.ceil(left / 1000)} s.` : ' Trying now…';
}

function renderSignIn(message) {
  document.title = 'Sign in · Raahi';
  const main = document.getElementById('main');
  const input = h('input', {
    id: 'token', name: 'token', type: 'password', autocomplete: 'off', spellcheck: 'false',
    required: true, 'data-testid': 'token-input', 'aria-describedby': 'token-help',
  });
  const button = h('button', { type: 'submit', class: 'btn btn-primary', 'data-testid': 'sign-in' },
    'Sign in');
  const note = h('p', { id: 'sign-in-message', class: 'form-message', role: 'alert',
    'data-testid': 'sign-in-message' }, message || '');
  const form = h('form', { class: 'sign-in-form', method: 'post', novalidate: true },
    h('label', { for: 'token' }, 'API token'),
    input,
    h('p', { id: 'token-help', class: 'help' },
      'An admin or viewer token of this gateway. It is kept in this browser tab only and is ',
      'forgotten when you sign out or close the tab.'),
    note,
    button);
  form.addEventListener('submit', async (event) => {
    event.preventDefault();
    const token = input.value.trim();
    if (!token) {
      note.textContent = 'Enter a token.';
      input.focus();
      return;
    }
    button.disabled = true;
    button.textContent = 'Checking…';
    note.textContent = '';
    try {
      const session = await checkToken(token);
      if (session === null) {
        note.textContent = 'The gateway did not accept this token (401). Check it and try again.';
        input.select();
        input.focus();
        return;
      }
      sessionStorage.setItem(TOKEN_KEY, token);
      input.value = '';
      enter(token, session);
    } catch (error) {
      note.textContent = `Cannot reach the gateway: ${error.message}.`;
    } finally {
      button.disabled = false;
      button.textContent = 'Sign in';
    }
  });
  main.replaceChildren(h('section', { class: 'sign-in', 'aria-labelledby': 'sign-in-title',
    'data-testid': 'sign-in-view' },
  h('h1', { id: 'sign-in-title' }, 'Sign in to Raahi'),
  h('p', { class: 'lead' }, 'Live view of services, targets and discovery sources.'),
  form));
  input.focus();
}

function loadingView() {
  return h('section', { class: 'empty', 'data-testid': 'loading', 'data-key': 'loading' },
    h('h1', null, 'Loading…'),
    h('p', { class: 'muted' }, 'Waiting for the first snapshot from the event stream.'));
}

function notFoundView(text) {
  document.title = 'Not found · Raahi';
  return h('section', { class: 'empty', 'data-testid': 'not-found', 'data-key': 'not-found' },
    h('h1', null, 'Not found'),
    h('p', null, text),
    h('p', null, h('a', { href: '#/' }, 'Back to all services')));
}

function badge(word, label = word, extra = {}) {
  return h('span', { class: `badge b-${word}`, ...extra }, label);
}

function servicesTargets(id) {
  return [...state.targets.values()].filter((t) => t.service_id === id);
}

function servicesSources(id) {
  return [...state.sources.values()].filter((s) => s.service_id === id).sort(byName);
}

function counts(targets, now) {
  const c = { active: 0, draining: 0, stale: 0, healthy: 0, unhealthy: 0, unknown: 0,
    ejected: 0, available: 0 };
  for (const t of targets) {
    c[t.state] = (c[t.state] ?? 0) + 1;
    c[t.health] = (c[t.health] ?? 0) + 1;
    if (isEjected(t, now)) c.ejected += 1;
    if (isAvailable(t, now)) c.available += 1;
  }
  return c;
}

function tiersOf(targets) {
  const tiers = new Map();
  for (const t of [...targets].sort(byTierThenAddress)) {
    if (!tiers.has(t.priority)) tiers.set(t.priority, []);
    tiers.get(t.priority).push(t);
  }
  return [...tiers.entries()].sort((a, b) => a[0] - b[0]);
}

function tierBars(targets, now) {
  if (targets.length === 0) return h('p', { class: 'muted small' }, 'No targets yet.');
  return h('div', { class: 'tiers' }, tiersOf(targets).map(([priority, members]) => {
    const available = members.filter((t) => isAvailable(t, now)).length;
    return h('div', { class: 'tier', 'data-testid': `tier-${priority}`, 'data-key': `tier-${priority}` },
      h('div', { class: 'tier-label' },
        h('span', null, `Priority ${priority}`),
        h('span', { class: available === 0 ? 'tier-count bad' : 'tier-count' },
          `${available}/${members.length} available`)),
      h('ul', { class: 'blocks', 'aria-label': `Targets at priority ${priority}` },
        members.map((t) => {
          const c = condition(t, now);
          const text = `${describeTarget(t, now)} (${CONDITION_LABEL[c]})`;
          return h('li', { class: `block c-${c}`, role: 'img', 'aria-label': text, title: text,
            'data-testid': `block-${t.id}`, 'data-key': `block-${t.id}`, 'data-condition': c });
        })));
  }));
}

function sourceSchedule(source, now) {
  const s = source.status;
  if (!s) return null;
  if (s.watch) {
    return s.watch.connected
      ? h('span', null, 'watch connected since ', absTime(s.watch.since))
      : h('span', { class: 'warn-text' }, 'watch disconnected since ', absTime(s.watch.since));
  }
  if (s.state === 'disabled' || source.enabled === false) return null;
  if (s.next_refresh_at) {
    // Refreshes that change nothing send no event: once the time shown has passed, say how
    // often the source refreshes instead of a time in the past.
    if (new Date(s.next_refresh_at).getTime() > now) {
      return h('span', null, 'next refresh ', relTime(s.next_refresh_at));
    }
    const every = s.last_refresh_at
      ? new Date(s.next_refresh_at).getTime() - new Date(s.last_refresh_at).getTime() : 0;
    return h('span', null, every > 0 ? `refreshes about every ${spanText(every)}` : 'refreshing');
  }
  return null;
}

function guardLine(source) {
  const guard = source.status?.guard;
  if (!guard || !guard.holding) return null;
  return h('p', { class: 'guard', 'data-testid': `guard-${source.id}` },
    h('strong', null, `Guard holding ${plural(guard.holding, 'removal')}`),
    ' since ', absTime(guard.since),
    `, ${plural(guard.confirmations ?? 0, 'confirmation')}`,
    guard.reason ? `: ${guard.reason}` : '');
}

function sourceState(source) {
  return source.status?.state ?? (source.enabled === false ? 'disabled' : 'pending');
}

function serviceCard(service, now) {
  const targets = servicesTargets(service.id);
  const sources = servicesSources(service.id);
  const c = counts(targets, now);
  const troubled = c.unhealthy > 0 || c.ejected > 0 || (targets.length > 0 && c.available === 0)
    || sources.some((s) => ['failing', 'stale'].includes(sourceState(s)) || s.status?.guard?.holding);
  return h('article', {
    class: `card${troubled ? ' attention' : ''}`, 'data-testid': `service-card-${service.id}`,
    'data-key': `service-card-${service.id}`,
    'aria-labelledby': `service-${service.id}-name`,
  },
  h('header', { class: 'card-head' },
    h('h2', { id: `service-${service.id}-name` },
      h('a', { href: `#/services/${service.id}`, 'data-testid': `service-link-${service.id}` },
        service.name)),
    badge('proto', service.protocol)),
  h('dl', { class: 'stats' },
    stat('Available', `${c.available} of ${targets.length}`, c.available === 0 && targets.length ? 'bad' : ''),
    stat('Panic picks', String(service.panic_picks ?? 0), service.panic_picks ? 'bad' : '')),
  countLines(c),
  tierBars(targets, now),
  sources.length ? h('ul', { class: 'source-lines', 'aria-label': 'Discovery sources' },
    sources.map((source) => {
      const st = sourceState(source);
      const error = source.status?.last_error;
      return h('li', { 'data-testid': `source-line-${source.id}`, 'data-state': st,
        'data-key': `source-line-${source.id}` },
        h('div', { class: 'source-line-head' },
          h('span', { class: 'source-name' }, source.name),
          source.provider ? h('span', { class: 'muted small' }, source.provider) : null,
          badge(st),
          h('span', { class: 'muted small' }, sourceSchedule(source, now))),
        error ? h('p', { class: 'error-text small' }, `Last error: ${error}`) : null,
        guardLine(source));
    })) : h('p', { class: 'muted small' }, 'No discovery sources.'));
}

/** Two lines of counts: lifecycle, then health; zeros muted, trouble coloured. */
function countLines(c) {
  const item = (n, word, tone) => h('span', {
    class: n === 0 ? 'count zero' : `count ${tone}`, 'data-count': word,
  }, h('strong', null, String(n)), ` ${word}`);
  return h('div', { class: 'count-lines' },
    h('p', { 'aria-label': 'Targets by state' },
      item(c.active, 'active', ''), item(c.draining, 'draining', 'warn'),
      item(c.stale, 'stale', 'bad')),
    h('p', { 'aria-label': 'Targets by health' },
      item(c.healthy, 'healthy', 'good'), item(c.unhealthy, 'unhealthy', 'bad'),
      item(c.ejected, 'ejected', 'warn')));
}

function stat(label, value, tone = '') {
  return h('div', { class: 'stat' }, h('dt', null, label), h('dd', { class: tone }, value));
}

function overviewPage() {
  document.title = 'Services · Raahi';
  const now = Date.now();
  const services = [...state.services.values()].sort(byName);
  const nTargets = state.targets.size;
  return h('div', { class: 'page', 'data-testid': 'overview', 'data-key': 'overview' },
    h('div', { class: 'page-head' },
      h('div', null,
        h('h1', null, 'Services'),
        h('p', { class: 'muted' },
          `${plural(services.length, 'service')} · ${plural(nTargets, 'target')} · `,
          `${plural(state.sources.size, 'discovery source')}`)),
      legend()),
    services.length === 0
      ? h('p', { class: 'empty-note' }, 'No services yet. Create one through the admin API.')
      : h('div', { class: 'cards' }, services.map((s) => serviceCard(s, now))),
    activitySection(null));
}

/** Recent changes: all, a service's (`serviceId`), or those of some `kinds` of event. */
function activitySection(serviceId, kinds = null) {
  const items = state.activity.filter((a) => (serviceId === null || a.service_id === serviceId)
    && (kinds === null || kinds.includes(a.kind)))
    .slice(0, serviceId === null && kinds === null ? 15 : 10);
  return h('section', { class: 'activity', 'aria-labelledby': 'activity-title',
    'data-testid': 'activity' },
  h('h2', { id: 'activity-title' }, 'Recent changes'),
  items.length === 0
    ? h('p', { class: 'muted small' }, 'Nothing has changed since this page opened.')
    // A service's page has no service column: its rows use a grid without one, so what
    // changed keeps the wide column instead of falling into the service's narrow one.
    : h('ol', { class: serviceId === null ? 'activity-list' : 'activity-list in-service' },
      items.map((a) => h('li', {
        class: `tone-${a.tone}`, 'data-key': `event-${a.id}`,
      },
      h('span', { class: 'activity-time' }, absTime(a.at)),
      serviceId !== null ? null
        : a.service_id != null && state.services.get(a.service_id)
          ? h('a', { class: 'activity-service', href: `#/services/${a.service_id}` },
            state.services.get(a.service_id).name)
          : h('span', { class: 'activity-service' }),
      h('span', { class: 'activity-what' },
        a.subject ? [h('span', { class: 'activity-subject' }, breakableAddress(a.subject)), ' ']
          : null, a.what),
      a.reason ? h('span', { class: 'activity-reason' }, a.reason) : null))));
}

// ---------------------------------------------------------------------------------------------
// The routes page (`#/routes`, `#/routes/{id}`) and a service's routes
// ---------------------------------------------------------------------------------------------

/** `90 %`, `33.3 %`: a share to one decimal, a whole number without one. */
function percentText(value) {
  return `${Math.round(value * 10) / 10} %`;
}

/**
 * Each backend's share of the route's requests, in percent of the total weight; with a canary,
 * the canary backend's weight now and the others sharing the rest in their proportions (as the
 * gateway computes them, in ten-thousandths).
 */
function backendShares(route) {
  const backends = route.backends ?? [];
  const status = route.canary ? canaryStatusOf(route) : null;
  if (status) {
    const at = route.canary.backend;
    const others = backends.reduce((sum, b, i) => (i === at ? sum : sum + Number(b.weight ?? 0)), 0);
    const rest = 100 * (100 - status.weight);
    return backends.map((b, i) => {
      if (i === at) return status.weight;
      return others > 0 ? Math.floor((rest * Number(b.weight ?? 0)) / others) / 100 : 0;
    });
  }
  const total = backends.reduce((sum, b) => sum + Number(b.weight ?? 0), 0);
  return backends.map((b) => (total > 0 ? (Number(b.weight ?? 0) * 100) / total : 0));
}

function serviceName(id) {
  return state.services.get(id)?.name ?? `service ${id}`;
}

function serviceRef(id) {
  return h('a', { href: `#/services/${id}`, class: 'service-ref', 'data-service-id': id },
    serviceName(id));
}

/** `['prefix', '/api']`, `['exact', '/login']` or `['regex', '/items/[0-9]+']`. */
function pathForm(route) {
  if (route.path_exact !== null && route.path_exact !== undefined) return ['exact', route.path_exact];
  if (route.path_regex !== null && route.path_regex !== undefined) return ['regex', route.path_regex];
  return ['prefix', route.path_prefix ?? '/'];
}

function subsetChips(subset) {
  const pairs = Object.entries(subset ?? {});
  if (pairs.length === 0) return null;
  return h('span', { class: 'labels', 'aria-label': 'Subset' },
    pairs.map(([key, value]) => [' ', h('code', { class: 'label-chip', 'data-label': key },
      `${key}=${value}`)]));
}

const CONDITION_KINDS = [['headers', 'header'], ['query', 'query'], ['cookies', 'cookie']];

/** `header x-canary = 1`, `query v ~ v[2-9]`, `cookie beta present`. */
function conditionLine(word, condition) {
  let test;
  if (condition.value !== null && condition.value !== undefined) {
    test = ['= ', h('code', null, condition.value)];
  } else if (condition.regex !== null && condition.regex !== undefined) {
    test = [h('span', { title: 'matches the whole value' }, '~'), ' ', h('code', null, condition.regex)];
  } else {
    test = condition.present === false ? 'absent' : 'present';
  }
  return h('li', { class: 'condition', 'data-condition-kind': word },
    h('span', { class: 'cond-kind' }, word), ' ', h('code', null, condition.name), ' ', test);
}

function routeConditions(route) {
  const lines = CONDITION_KINDS.flatMap(([field, word]) => (route[field] ?? [])
    .map((c) => conditionLine(word, c)));
  return lines.length ? h('ul', { class: 'conditions' }, lines)
    : h('span', { class: 'muted' }, 'none');
}

function routeMatch(route) {
  const [form, path] = pathForm(route);
  const hosts = route.hosts ?? [];
  const methods = route.methods ?? [];
  return h('div', { class: 'match' },
    h('div', { class: 'match-hosts' }, hosts.length
      ? hosts.map((host, i) => [i ? ', ' : '', h('code', null, host)])
      : h('span', { class: 'muted' }, 'any host')),
    h('div', { class: 'match-path' },
      h('span', { class: 'path-form', 'data-form': form }, form), ' ', h('code', null, path)),
    h('div', { class: 'match-methods' }, methods.length
      ? h('code', null, methods.join(' '))
      : h('span', { class: 'muted' }, 'any method')));
}

function routeBackends(route) {
  const backends = route.backends ?? [];
  if (backends.length === 0) {
    return h('span', { class: 'muted' }, route.redirect ? 'none: Raahi answers' : 'none');
  }
  const shares = backendShares(route);
  const canaryAt = route.canary ? route.canary.backend : null;
  return h('ul', { class: 'backends' }, backends.map((b, i) => h('li', {
    class: 'backend', 'data-key': `backend-${i}`, 'data-testid': `route-${route.id}-backend-${i}`,
    'data-service-id': b.service_id, 'data-share': String(Math.round(shares[i] * 10) / 10),
  },
  h('span', { class: 'backend-head' },
    h('span', null, serviceRef(b.service_id),
      i === canaryAt ? [' ', badge('canary-backend', 'canary')] : null), ' ',
    h('span', { class: 'share', title: canaryAt === null ? `weight ${b.weight}`
      : `weight ${b.weight}; the canary sets the shares now` }, percentText(shares[i]))),
  subsetChips(b.subset),
  h('meter', { class: 'share-bar', min: 0, max: 100, value: shares[i], 'aria-hidden': 'true' }))));
}

/** Where a redirect sends, `…` standing for what is kept from the request (host, path). */
function redirectTarget(redirect) {
  const scheme = redirect.scheme ? `${redirect.scheme}://` : '';
  const host = redirect.hostname ?? (scheme || redirect.port ? '…' : '');
  const port = redirect.port ? `:${redirect.port}` : '';
  let path = redirect.path ?? (redirect.prefix ? `${redirect.prefix}…` : '…');
  if (path === '…' && host === '…' && !port) path = '';
  return `${scheme}${host}${port}${path}`;
}

function headerFilterText(filter) {
  const parts = [];
  const set = Object.keys(filter.set ?? {});
  const add = Object.keys(filter.add ?? {});
  if (set.length) parts.push(`set ${set.join(', ')}`);
  if (add.length) parts.push(`add ${add.join(', ')}`);
  if ((filter.remove ?? []).length) parts.push(`remove ${filter.remove.join(', ')}`);
  return parts.join('; ');
}

function filterBadge(key, label, title = null) {
  return h('span', { class: `badge filter f-${key}`, 'data-filter': key, title }, label);
}

/** A badge per filter the route has, each saying briefly what it does. */
function routeFilters(route) {
  const out = [];
  const r = route.redirect;
  if (r) {
    const status = r.status ?? 302;
    out.push(filterBadge('redirect', `redirect → ${redirectTarget(r)} · ${status}`,
      `Answered by Raahi with ${status}; what the target does not name is kept from the request, the query string included`));
  }
  const w = route.rewrite;
  if (w && (w.hostname || w.path || w.prefix)) {
    const parts = [];
    if (w.path) parts.push(`path ${w.path}`);
    if (w.prefix) parts.push(`prefix ${w.prefix}`);
    if (w.hostname) parts.push(`host ${w.hostname}`);
    out.push(filterBadge('rewrite', `rewrite ${parts.join(' · ')}`));
  }
  const m = route.mirror;
  if (m) {
    out.push(filterBadge('mirror', `mirror → ${serviceName(m.service_id)} ${percentText(m.percent ?? 100)}`,
      'A copy of these requests is sent there; its answers are dropped'));
  }
  const c = route.cors;
  if (c) {
    const origins = c.allow_origins ?? [];
    out.push(filterBadge('cors', 'cors', origins.length ? `Origins: ${origins.join(', ')}`
      : 'No origin allowed'));
  }
  for (const [field, label] of [['request_headers', 'request headers'],
    ['response_headers', 'response headers']]) {
    const text = route[field] ? headerFilterText(route[field]) : '';
    if (text) out.push(filterBadge(field.replace('_', '-'), label, text));
  }
  const t = route.timeouts ?? {};
  if (t.request_ms != null || t.backend_request_ms != null) {
    const parts = [];
    if (t.request_ms != null) parts.push(`request ${spanText(t.request_ms)}`);
    if (t.backend_request_ms != null) parts.push(`attempt ${spanText(t.backend_request_ms)}`);
    out.push(filterBadge('timeouts', 'timeouts', parts.join(' · ')));
  }
  return out;
}

function routeRow(route, picked) {
  const filters = routeFilters(route);
  const notes = [];
  if (route.priority) notes.push(`priority ${route.priority}`);
  if (route.strip_prefix) notes.push('strips its prefix');
  if (route.preserve_host) notes.push('keeps the Host');
  if (route.managed_by) notes.push(`managed by ${route.managed_by}`);
  return h('tr', {
    class: picked ? 'route-row selected' : 'route-row',
    'data-key': `route-${route.id}`,
    'data-testid': `route-row-${route.id}`,
    'data-route-id': route.id,
    'data-route-name': route.name,
    'aria-current': picked ? 'true' : null,
  },
  h('th', { scope: 'row', class: 'route-name' },
    h('span', { 'data-testid': `route-name-${route.id}` }, route.name),
    notes.length ? h('div', { class: 'muted small' }, notes.join(' · ')) : null,
    route.canary ? h('div', null, canaryBadge(route)) : null),
  h('td', null, routeMatch(route)),
  h('td', null, routeConditions(route)),
  h('td', null, routeBackends(route)),
  h('td', null, filters.length ? h('div', { class: 'filters' }, filters)
    : h('span', { class: 'muted' }, 'none')),
  h('td', null, routeLimits(route)));
}

function routesPage(picked) {
  document.title = 'Routes · Raahi';
  const list = state.routes;
  const routes = [...list.items].sort(byName);
  const redirects = routes.filter((r) => r.redirect).length;
  const summary = list.loaded
    ? `${plural(routes.length, 'route')}${redirects ? ` · ${plural(redirects, 'redirect')}` : ''}`
    : 'Reading the routes…';
  let body;
  if (!list.loaded) {
    body = list.error ? null : h('p', { class: 'muted' }, 'Loading…');
  } else if (routes.length === 0) {
    body = h('p', { class: 'empty-note' }, 'No routes yet. Create one through the admin API.');
  } else {
    body = h('div', { class: 'table-wrap', 'data-scroll': 'routes' },
      h('table', { class: 'grid routes', 'data-testid': 'routes-table' },
        h('caption', { class: 'sr-only' },
          'HTTP routes by name: what each matches, its conditions, where it sends, its filters and its limits.'),
        h('thead', null, h('tr', null,
          h('th', { scope: 'col' }, 'Route'),
          h('th', { scope: 'col' }, 'Match'),
          h('th', { scope: 'col' }, 'Conditions'),
          h('th', { scope: 'col' }, 'Backends'),
          h('th', { scope: 'col' }, 'Filters'),
          h('th', { scope: 'col' }, 'Limits'))),
        h('tbody', null, routes.map((r) => routeRow(r, r.id === picked)))));
  }
  return h('div', { class: 'page', 'data-testid': 'routes-page', 'data-key': 'routes',
    'data-loaded': String(list.loaded) },
  h('div', { class: 'page-head' },
    h('div', null,
      h('h1', null, 'Routes'),
      h('p', { class: 'muted', 'data-testid': 'routes-summary' }, summary))),
  list.error ? h('p', { class: 'error-box', role: 'alert', 'data-testid': 'routes-error' },
    list.error) : null,
  canariesSection(routes),
  h('section', { class: 'panel', 'aria-label': 'HTTP routes' }, body),
  activitySection(null, ['route', 'canary']));
}

// ---------------------------------------------------------------------------------------------
// A route's canary: its steps, weight, the interval being judged and its decisions
// ---------------------------------------------------------------------------------------------

/** What an operator may ask of a canary in each state (others would change nothing, or 409). */
const CANARY_VERBS = {
  progressing: ['pause', 'promote', 'rollback'],
  paused: ['resume', 'promote', 'rollback'],
  rolled_back: ['resume', 'promote'],
  promoted: ['rollback'],
};
const CANARY_VERB_LABEL = { pause: 'Pause', resume: 'Resume', promote: 'Promote', rollback: 'Roll back' };

/** `rolled back`, `progressing`. */
function stateWord(word) {
  return String(word).replace(/_/g, ' ');
}

function stateClass(word) {
  return String(word).replace(/_/g, '-');
}

/** `0.5 %`, `12.35 %`: an error share to two decimals. */
function errorPercentText(value) {
  if (value === null || value === undefined) return '—';
  return `${Math.round(Number(value) * 100) / 100} %`;
}

/** `1.2 ms`, `480 ms`, `2 s`; `—` without timed requests. */
function p99Text(ms) {
  if (ms === null || ms === undefined) return '—';
  if (ms >= 1000) return spanText(ms);
  return `${ms >= 100 ? Math.round(ms) : Math.round(ms * 10) / 10} ms`;
}

function canaryCountsText(c) {
  return `${plural(c.requests ?? 0, 'request')} · ${errorPercentText(c.error_percent)} errors · `
    + `p99 ${p99Text(c.p99_ms)}`;
}

/** `canary 25 % · progressing`, coloured by the state, the last decision's reason on hover. */
function canaryBadge(route) {
  const status = canaryStatusOf(route);
  const st = status?.state ?? 'pending';
  return badge(`canary-${stateClass(st)}`,
    `canary ${status ? `${status.weight} %` : '…'} · ${stateWord(st)}`, {
      'data-testid': `route-canary-${route.id}`, 'data-state': st,
      'data-weight': status ? String(status.weight) : null, title: status?.reason ?? null,
    });
}

/** The steps in a row (5 % → 25 % → 50 % → 100 %): passed, the one in force, those to come. */
function canarySteps(route, status, compact = false) {
  const steps = route.canary.steps ?? [];
  const st = status?.state ?? 'pending';
  const at = status?.step ?? 0;
  return h('ol', {
    class: `canary-steps${compact ? ' compact' : ''}`,
    'data-testid': compact ? null : `canary-steps-${route.id}`,
    'aria-label': `Canary steps: ${steps.map((w) => `${w} %`).join(', ')}`,
  }, steps.map((weight, i) => {
    let phase;
    if (st === 'promoted' || i < at) phase = 'done';
    else if (i === at && status) phase = st === 'rolled_back' ? 'failed' : 'current';
    else phase = 'next';
    const words = { done: 'passed', current: `in force (${stateWord(st)})`,
      failed: 'rolled back here', next: 'to come' };
    return h('li', {
      class: `step step-${phase}`, 'data-key': `step-${i}`, 'data-phase': phase,
      'aria-current': phase === 'current' ? 'step' : null,
      title: `Step ${i + 1}, ${weight} %: ${words[phase]}`,
    }, `${weight} %`);
  }));
}

/** The canary routes of the routes page, each with its progress. */
function canariesSection(routes) {
  const canaries = routes.filter((r) => r.canary);
  if (canaries.length === 0) return null;
  return h('section', { class: 'panel', 'aria-labelledby': 'canaries-title',
    'data-testid': 'canaries', 'data-key': 'canaries' },
  h('h2', { id: 'canaries-title' }, 'Canaries'),
  h('div', { class: 'canary-cards' }, canaries.map(canaryCard)));
}

function canaryIntervalText(route, view, st) {
  const interval = view?.interval;
  if (!interval) return '—';
  const round = `round ${interval.round} · `;
  const testid = `canary-interval-${route.id}`;
  if (st === 'progressing' && interval.ends_at) {
    return h('span', { 'data-testid': testid }, round, 'started ',
      relTime(interval.started_at), ' · ends ', relTime(interval.ends_at));
  }
  if (st === 'paused') {
    return h('span', { 'data-testid': testid }, round, 'paused ',
      relTime(interval.started_at), ' · not judged while paused');
  }
  return h('span', { 'data-testid': testid }, round, `${stateWord(st)} `,
    relTime(interval.started_at), ' · no longer judged');
}

function canaryBoundsText(canary) {
  const p99 = canary.max_p99_ms === null || canary.max_p99_ms === undefined
    ? 'p99 not judged' : `p99 ≤ ${p99Text(canary.max_p99_ms)}`;
  return `every ${spanText(canary.step_interval_ms)}, at least ${plural(canary.min_requests, 'request')}`
    + ` to the canary · errors ≤ ${canary.max_error_percent} % · ${p99}`;
}

function canaryCard(route) {
  const canary = route.canary;
  const entry = state.canaries.get(route.id);
  const view = entry?.view ?? null;
  const status = canaryStatusOf(route);
  const st = status?.state ?? 'pending';
  const weight = status ? status.weight : null;
  const backend = (route.backends ?? [])[canary.backend];
  const key = `canary-${route.id}`;
  return h('article', {
    class: `canary-card canary-${stateClass(st)}`, 'data-key': key, 'data-testid': key,
    'data-state': st, 'data-weight': weight === null ? null : String(weight),
    'data-step': status ? String(status.step) : null,
    'data-round': status ? String(status.round) : null,
    'aria-labelledby': `${key}-name`,
  },
  h('header', { class: 'canary-head' },
    h('h3', { id: `${key}-name` }, h('a', { href: `#/routes/${route.id}` }, route.name)),
    badge(`canary-${stateClass(st)}`, stateWord(st), { 'data-testid': `canary-state-${route.id}` }),
    h('span', { class: 'muted small' }, 'canary backend ',
      backend ? serviceRef(backend.service_id) : `#${canary.backend}`)),
  h('div', { class: 'canary-progress' },
    h('div', { class: 'canary-weight' },
      h('strong', { 'data-testid': `canary-weight-${route.id}` }, weight === null ? '—' : `${weight} %`),
      h('span', { class: 'muted small' }, ' of the route\u2019s requests')),
    canarySteps(route, status)),
  h('dl', { class: 'kv canary-kv' },
    kv('Last decision', h('span', { 'data-testid': `canary-reason-${route.id}` },
      status?.reason ?? '—')),
    kv('Interval', canaryIntervalText(route, view, st)),
    kv('Judged by', h('span', { 'data-testid': `canary-judged-by-${route.id}` }, view
      ? view.judged_by ?? h('span', { class: 'muted' }, 'no gateway holds its lease') : '—')),
    kv('Bounds', canaryBoundsText(canary))),
  view ? canaryCounts(route, view)
    : entry?.error ? null : h('p', { class: 'muted small' }, 'Loading…'),
  state.session.role === 'admin' ? canaryActions(route, st) : null,
  entry?.error ? h('p', { class: 'action-error', role: 'alert' }, entry.error) : null,
  view ? canaryHistory(route, view) : null);
}

/** Each backend's share and requests in the interval being judged, by every gateway. */
function canaryCounts(route, view) {
  const counts = view.interval?.counts ?? [];
  const limit = route.canary.max_error_percent;
  return h('div', { class: 'table-wrap canary-counts-wrap' },
    h('table', { class: 'grid canary-counts', 'data-testid': `canary-counts-${route.id}` },
      h('caption', { class: 'sr-only' },
        'Each backend\u2019s share, and its requests in the interval being judged (every gateway\u2019s)'),
      h('thead', null, h('tr', null,
        h('th', { scope: 'col' }, 'Backend'),
        h('th', { scope: 'col', class: 'num' }, 'Share'),
        h('th', { scope: 'col', class: 'num' }, 'Requests'),
        h('th', { scope: 'col', class: 'num' }, 'Errors'),
        h('th', { scope: 'col', class: 'num' }, 'Error %'),
        h('th', { scope: 'col', class: 'num' }, 'p99'))),
      h('tbody', null, (view.weights ?? []).map((w, i) => {
        const c = counts[i] ?? {};
        const over = w.canary && Number(c.error_percent ?? 0) > limit;
        return h('tr', { 'data-key': `backend-${i}`, 'data-backend': String(i),
          'data-canary': String(Boolean(w.canary)), class: w.canary ? 'canary-row' : null },
        h('th', { scope: 'row' }, serviceRef(w.service_id),
          w.canary ? [' ', badge('canary-backend', 'canary')] : null),
        h('td', { class: 'num', 'data-field': 'share' }, percentText(w.percent)),
        h('td', { class: 'num', 'data-field': 'requests' }, String(c.requests ?? 0)),
        h('td', { class: 'num', 'data-field': 'errors' }, String(c.errors ?? 0)),
        h('td', { class: over ? 'num bad' : 'num', 'data-field': 'error-percent' },
          errorPercentText(c.error_percent ?? 0)),
        h('td', { class: 'num', 'data-field': 'p99' }, p99Text(c.p99_ms)));
      }))));
}

function canaryActions(route, st) {
  const key = `canary-${route.id}`;
  const busy = state.busy.has(key);
  const error = state.errors.get(key);
  const first = (route.canary.steps ?? [])[0];
  const hint = {
    pause: 'Hold the canary at its weight; it is not judged while paused',
    resume: st === 'rolled_back' ? `Start again at step 1 (${first} %)`
      : 'Judge the canary again, from a new interval',
    promote: 'Send the canary backend every request (100 %) now',
    rollback: 'Send the canary backend nothing (0 %) now',
  };
  return h('div', { class: 'canary-actions' },
    (CANARY_VERBS[st] ?? []).map((verb) => h('button', {
      type: 'button', class: verb === 'rollback' ? 'btn btn-small btn-warn' : 'btn btn-small',
      // Keyed: a button that goes away takes its focus with it, never handing it to another.
      'data-key': `canary-${verb}`,
      'data-testid': `canary-${verb}-${route.id}`, 'data-focus': `canary-${verb}-${route.id}`,
      'data-action': `canary-${verb}`, 'data-id': route.id, disabled: busy, title: hint[verb],
    }, CANARY_VERB_LABEL[verb])),
    error ? h('p', { class: 'action-error', role: 'alert', 'data-testid': `action-error-${key}` },
      error) : null);
}

/** The canary's decisions, newest first, each with the canary backend's counts it was taken on. */
function canaryHistory(route, view) {
  const oldestFirst = view.history ?? [];
  const at = route.canary.backend;
  const items = oldestFirst.map((d, i) => {
    const before = oldestFirst[i - 1];
    let tone = canaryTone(d.state);
    if (d.state === 'progressing' && before) {
      if (d.weight > before.weight) tone = 'good';
      else if (d.weight === before.weight && before.state === 'progressing') tone = 'muted';
    }
    return { d, tone };
  }).reverse();
  return h('section', { class: 'canary-decisions', 'aria-labelledby': `canary-${route.id}-history` },
    h('h4', { id: `canary-${route.id}-history` }, 'Decisions',
      h('span', { class: 'muted small' }, ` · newest first · ${plural(items.length, 'entry', 'entries')}`)),
    items.length === 0 ? h('p', { class: 'muted small' }, 'None yet.')
      : h('ol', { class: 'history-list canary-history', 'data-testid': `canary-history-${route.id}` },
        items.map(({ d, tone }) => {
          const c = (d.counts ?? [])[at];
          return h('li', {
            class: `tone-${tone}`, 'data-key': `decision-${d.round}`, 'data-testid': 'canary-decision',
            'data-round': String(d.round), 'data-state': d.state, 'data-weight': String(d.weight),
          },
          h('span', { class: 'activity-time' }, absTime(d.at)),
          h('span', { class: 'history-change' }, `${stateWord(d.state)} · ${d.weight} %`),
          h('span', { class: 'decision-counts small', 'data-field': 'counts' },
            c ? canaryCountsText(c) : h('span', { class: 'muted' }, 'no interval judged')),
          h('span', { class: 'activity-reason' }, d.reason));
        })));
}

/** What a route sends to service `id`: each backend's share (with its subset) and the mirror. */
function serviceRoles(route, id) {
  const shares = backendShares(route);
  const roles = [];
  (route.backends ?? []).forEach((b, i) => {
    if (b.service_id !== id) return;
    roles.push(h('span', { class: 'role-line' }, badge('backend', `backend ${percentText(shares[i])}`),
      subsetChips(b.subset)));
  });
  if (route.mirror && route.mirror.service_id === id) {
    roles.push(h('span', { class: 'role-line' },
      badge('mirror', `mirror ${percentText(route.mirror.percent ?? 100)}`)));
  }
  if (route.canary) roles.push(h('span', { class: 'role-line' }, canaryBadge(route)));
  return roles;
}

/** The routes that send to service `id`, as a backend or a mirror. */
function serviceRoutesSection(id) {
  const list = state.routes;
  const routes = list.items.filter((r) => sendsTo(r, id)).sort(byName);
  let body;
  if (!list.loaded) body = list.error ? null : h('p', { class: 'muted small' }, 'Loading…');
  else if (routes.length === 0) body = h('p', { class: 'muted' }, 'No route sends requests here.');
  else {
    body = h('ul', { class: 'service-routes' }, routes.map((route) => {
      const [form, path] = pathForm(route);
      const hosts = route.hosts ?? [];
      return h('li', { 'data-key': `service-route-${route.id}`,
        'data-testid': `service-route-${route.id}`, 'data-route-id': route.id },
      h('a', { href: `#/routes/${route.id}`, class: 'route-link',
        'data-testid': `service-route-link-${route.id}` }, route.name),
      serviceRoles(route, id).map((role) => [' ', role]),
      h('span', { class: 'muted small route-where' },
        `${hosts.length ? hosts.join(', ') : 'any host'} · ${form} `, h('code', null, path)),
      hasLimits(route) ? routeLimits(route) : null,
      route.canary ? canarySteps(route, canaryStatusOf(route), true) : null);
    }));
  }
  return h('section', { class: 'panel', 'aria-labelledby': 'service-routes-title',
    'data-testid': 'service-routes', 'data-loaded': String(list.loaded) },
  h('div', { class: 'panel-head' },
    h('h2', { id: 'service-routes-title' }, 'Routes'),
    h('a', { href: '#/routes', class: 'small' }, 'All routes')),
  list.error ? h('p', { class: 'error-box', role: 'alert' }, list.error) : null,
  body);
}

// What a service's health check asks, as its traffic speaks: gRPC's Health/Check for a
// service name ("the server" when none), HTTP/2 GETs for h2c services.
function checkKind(check, service) {
  if (check.type === 'grpc') return `gRPC Health/Check ${check.grpc_service || '(the server)'}`;
  if (check.type === 'http' || !check.type) {
    return `${service.protocol === 'h2c' ? 'HTTP/2 ' : 'HTTP '}GET ${check.path}`;
  }
  return check.type.toUpperCase();
}

// The policy with what it hashes (TRAFFIC.md §5): "maglev on header x-user, bounded at 125 %".
function balancingText(service) {
  const policy = service.lb_policy ?? '—';
  const on = service.hash_on;
  if (!on) return policy;
  const key = on === 'client_ip' ? 'client IP'
    : on.header ? `header ${on.header}` : on.cookie ? `cookie ${on.cookie}` : `query ${on.query}`;
  const bound = service.hash_balance_factor ? `, bounded at ${service.hash_balance_factor} %` : '';
  return `${policy} on ${key}${bound}`;
}

function sessionsText(service) {
  const sessions = service.session_persistence;
  if (!sessions) return 'off';
  const limits = [];
  if (sessions.idle_timeout_s) limits.push(`idle ${spanText(sessions.idle_timeout_s * 1000)}`);
  if (sessions.absolute_timeout_s) limits.push(`at most ${spanText(sessions.absolute_timeout_s * 1000)}`);
  return `cookie ${sessions.cookie}${limits.length ? ` (${limits.join(', ')})` : ''}`;
}

// Where the service's requests go by zone, and why: "zone a only (3 of 3 available, ≥ 70 %)".
function localityText(service, view) {
  if (!service.locality) return null;
  const threshold = `≥ ${service.locality.min_available_percent} %`;
  if (!view) return `configured (${threshold})`;
  switch (view.in_force) {
    case 'zone_only':
      return `zone ${view.zone} only (${view.available} of ${view.total} available, ${threshold}${view.basis === 'hints' ? ', by hints' : ''})`;
    case 'all_zones': return `every zone: ${view.reason}`;
    case 'no_zone_configured': return 'off: the gateway has no cluster.zone';
    default: return `configured (${threshold})`;
  }
}

function servicePage(id) {
  const service = state.services.get(id);
  if (!service) return notFoundView(`There is no service ${id} (it may have been deleted).`);
  document.title = `${service.name} · Raahi`;
  const now = Date.now();
  const targets = servicesTargets(id).sort(byTierThenAddress);
  const sources = servicesSources(id);
  const c = counts(targets, now);
  const check = service.health_check;
  const checkText = check ? `${checkKind(check, service)} every ${spanText(check.interval_ms)}` : 'none';
  const ejection = service.ejection;
  const ejectionText = ejection && ejection.enabled
    ? `after ${ejection.failures} failures in ${spanText(ejection.window_ms)}` : 'off';
  return h('div', { class: 'page', 'data-testid': 'service-page', 'data-service-id': id,
    'data-key': `service-${id}` },
    h('nav', { class: 'crumbs', 'aria-label': 'Breadcrumb' },
      h('a', { href: '#/', 'data-testid': 'back' }, 'Services'), h('span', { 'aria-hidden': 'true' }, ' / '),
      h('span', { 'aria-current': 'page' }, service.name)),
    h('div', { class: 'page-head' },
      h('div', null,
        h('h1', null, service.name, ' ', badge('proto', service.protocol)),
        h('dl', { class: 'stats inline' },
          stat('Balancing', balancingText(service)),
          stat('Sessions', sessionsText(service)),
          localityText(service, state.localities.get(id)) === null ? null
            : stat('Locality', localityText(service, state.localities.get(id)),
              state.localities.get(id)?.in_force === 'all_zones' ? 'warn-text' : ''),
          stat('Health checks', checkText),
          stat('Ejection', ejectionText),
          stat('Available', `${c.available} of ${targets.length}`, c.available === 0 && targets.length ? 'bad' : ''),
          stat('Panic picks', String(service.panic_picks ?? 0), service.panic_picks ? 'bad' : ''),
          retryStats(service))),
      legend()),
    h('section', { class: 'panel', 'aria-labelledby': 'targets-title' },
      h('h2', { id: 'targets-title' }, 'Targets'),
      tierBars(targets, now),
      targets.length ? targetTable(targets, sources, now) : null,
      historyPanel()),
    h('section', { class: 'panel', 'aria-labelledby': 'sources-title' },
      h('h2', { id: 'sources-title' }, 'Discovery sources'),
      sources.length
        ? h('div', { class: 'source-cards' }, sources.map((s) => sourceCard(s, now)))
        : h('p', { class: 'muted' }, 'None: this service\u2019s targets are added through the API.')),
    serviceRoutesSection(id),
    activitySection(id));
}

/** `0/s`, `0.5/s`, `12/s`: a retry rate, to a tenth below 10 per second. */
function perSecondText(rate) {
  if (rate === null || rate === undefined) return '—';
  return `${rate >= 10 ? Math.round(rate) : Math.round(rate * 10) / 10}/s`;
}

/**
 * A service's retries on this gateway (TRAFFIC.md §5): the rate with the retries sent by
 * reason, the budget's window and its refusals, and the hedges; a stream service's are its
 * connect retries.
 */
function retryStats(service) {
  const entry = state.retries.get(service.id);
  const view = entry?.view;
  const count = (value) => (view ? String(value ?? 0) : '—');
  const reasons = Object.entries(view?.sent ?? {}).filter(([, n]) => n > 0)
    .map(([reason, n]) => `${reason} ${n}`).join(', ');
  const rate = entry?.rate;
  return [
    stat('Retries', h('span', { 'data-testid': 'service-retries' },
      h('span', { 'data-testid': 'service-retry-rate',
        title: 'Retries sent per second, between the last two reads' }, perSecondText(rate)),
      ' · ', h('span', { 'data-testid': 'service-retries-sent' }, count(entry?.sent)), ' sent',
      reasons ? h('span', { class: 'muted small', 'data-testid': 'service-retry-reasons' },
        ` (${reasons})`) : null), rate ? 'warn-text' : ''),
    stat('Retry budget', h('span', { 'data-testid': 'service-retry-budget' },
      h('span', { 'data-testid': 'service-retry-budget-exhausted' }, count(view?.budget_exhausted)),
      ' refused',
      view ? h('span', { class: 'muted small', 'data-testid': 'service-retry-window',
        title: 'Retries and hedges the budget allowed, and requests, in its 10 s window' },
      ` · ${plural(view.window_retries, 'retry', 'retries')} for `,
      `${plural(view.window_requests, 'request')} in the last 10 s`) : null),
    view?.budget_exhausted ? 'bad' : ''),
    stat('Hedges', h('span', { 'data-testid': 'service-hedges' }, count(view?.hedges))),
  ];
}

function targetTable(targets, sources, now) {
  const admin = state.session.role === 'admin';
  const sourceName = new Map(sources.map((s) => [s.id, s.name]));
  return h('div', { class: 'table-wrap', 'data-scroll': 'targets' },
    h('table', { class: 'targets', 'data-testid': 'targets-table' },
      h('caption', { class: 'sr-only' },
        'Targets of this service. Select a row (Enter) to show its history.'),
      h('thead', null, h('tr', null,
        h('th', { scope: 'col' }, 'Address'),
        h('th', { scope: 'col', class: 'num' }, 'Weight'),
        h('th', { scope: 'col', class: 'num' }, 'Priority'),
        h('th', { scope: 'col' }, 'State'),
        h('th', { scope: 'col' }, 'Health'),
        h('th', { scope: 'col' }, 'Ejected until'),
        h('th', { scope: 'col', class: 'num' }, 'In flight'),
        h('th', { scope: 'col' }, 'Source'),
        admin ? h('th', { scope: 'col' }, h('span', { class: 'sr-only' }, 'Actions')) : null)),
      h('tbody', null, targets.map((t) => targetRow(t, sourceName, admin, now)))));
}

function targetRow(t, sourceName, admin, now) {
  const c = condition(t, now);
  const open = state.openTarget === t.id;
  return h('tr', {
    tabindex: '0',
    class: `target-row${open ? ' selected' : ''}`,
    'data-testid': `target-row-${t.id}`,
    'data-key': `target-row-${t.id}`,
    'data-target-id': t.id,
    'data-focus': `row-${t.id}`,
    'data-state': t.state,
    'data-health': t.health,
    'data-enabled': String(Boolean(t.enabled)),
    'data-condition': c,
    'aria-expanded': String(open),
    'aria-controls': 'history',
    'aria-label': `${describeTarget(t, now)}. Press Enter for its history.`,
  },
  h('td', { class: 'addr' },
    h('span', { class: `block small c-${c}`, 'aria-hidden': 'true' }),
    h('code', null, address(t))),
  h('td', { class: 'num' }, String(t.weight)),
  h('td', { class: 'num' }, String(t.priority)),
  h('td', null, badge(t.state),
    t.enabled ? null : [' ', badge('disabled')],
    t.state === 'draining' && t.remove_at
      ? h('div', { class: 'muted small' }, 'removed ', relTime(t.remove_at)) : null),
  h('td', null, badge(t.health),
    t.last_check ? h('div', { class: 'muted small', title: `checked ${formatTime(t.last_check.at)}` },
      t.last_check.detail) : null),
  h('td', null, isEjected(t, now)
    ? h('span', { class: 'warn-text' }, absTime(t.ejected_until), ' ',
      h('span', { class: 'muted small' }, '(', relTime(t.ejected_until), ')'))
    : t.half_open ? badge('half-open', 'half-open trial') : h('span', { class: 'muted' }, '—')),
  h('td', { class: 'num' }, String(t.in_flight ?? 0)),
  h('td', null, t.source_id === null || t.source_id === undefined
    ? h('span', { class: 'muted' }, 'operator')
    : sourceName.get(t.source_id) ?? `source ${t.source_id}`),
  admin ? h('td', { class: 'actions' }, targetActions(t)) : null);
}

function targetActions(t) {
  if (t.source_id !== null && t.source_id !== undefined) {
    return h('span', { class: 'muted small', title: 'Owned by its discovery source; read-only' },
      'read-only');
  }
  const key = `target-${t.id}`;
  const busy = state.busy.has(key);
  const error = state.errors.get(key);
  return [
    h('button', {
      type: 'button', class: 'btn btn-small', 'data-testid': `toggle-target-${t.id}`,
      'data-focus': `toggle-${t.id}`, disabled: busy,
      'data-action': 'toggle-target', 'data-id': t.id,
      'aria-label': `${t.enabled ? 'Disable' : 'Enable'} ${address(t)}`,
    }, t.enabled ? 'Disable' : 'Enable'),
    error ? h('p', { class: 'action-error', role: 'alert', 'data-testid': `action-error-${key}` },
      error) : null,
  ];
}

function historyPanel() {
  const id = state.openTarget;
  if (id === null) return null;
  const target = state.targets.get(id);
  const history = state.history.get(id) ?? { items: [], loading: true };
  const title = target ? address(target) : `target ${id}`;
  return h('section', { id: 'history', class: 'history', 'data-testid': 'history',
    'data-target-id': id, 'aria-labelledby': 'history-title' },
  h('div', { class: 'history-head' },
    h('h3', { id: 'history-title' }, `History of ${title}`),
    h('button', { type: 'button', class: 'btn btn-small btn-quiet', 'data-testid': 'close-history',
      'data-focus': 'close-history', 'data-action': 'close-history' },
    'Close')),
  target?.last_check ? h('p', { class: 'muted small' },
    `Last check ${target.last_check.passed ? 'passed' : 'failed'}: ${target.last_check.detail} at `,
    absTime(target.last_check.at)) : null,
  history.error ? h('p', { class: 'action-error', role: 'alert' }, history.error) : null,
  history.items.length === 0
    ? h('p', { class: 'muted' }, history.loading ? 'Loading…'
      : 'No transitions recorded since this gateway started.')
    : h('ol', { class: 'history-list' }, history.items.map((item) => h('li', {
      'data-testid': 'history-entry', 'data-change': item.change, 'data-key': `event-${item.id}`,
      class: `tone-${toneOf(item.to ?? item.change)}`,
    },
    h('span', { class: 'activity-time' }, absTime(item.at)),
    h('span', { class: 'history-change' }, changeText(item)),
    h('span', { class: 'activity-reason' }, item.reason)))));
}

function sourceCard(source, now) {
  const s = source.status ?? {};
  const st = sourceState(source);
  const admin = state.session.role === 'admin';
  const refreshKey = `refresh-${source.id}`;
  const acceptKey = `accept-${source.id}`;
  const holding = Boolean(s.guard && s.guard.holding);
  const endpoints = s.endpoints ?? { active: 0, draining: 0, stale: 0 };
  return h('article', { class: 'source-card', 'data-testid': `source-${source.id}`,
    'data-key': `source-${source.id}`,
    'data-state': st, 'aria-labelledby': `source-${source.id}-name` },
  h('header', { class: 'source-head' },
    h('h3', { id: `source-${source.id}-name` }, source.name),
    source.provider ? h('span', { class: 'muted' }, source.provider) : null,
    badge(st)),
  h('dl', { class: 'kv' },
    kv('Endpoints', `${endpoints.active} active · ${endpoints.draining} draining · ${endpoints.stale} stale`),
    kv('Schedule', sourceSchedule(source, now) ?? '—'),
    kv('Last refresh', s.last_refresh_at ? relTime(s.last_refresh_at) : 'never'),
    kv('Last success', s.last_success_at ? relTime(s.last_success_at) : 'never'),
    s.failing_since ? kv('Failing since', absTime(s.failing_since)) : null,
    s.revision ? kv('Revision', h('code', null, s.revision)) : null,
    s.refreshed_by ? kv('Refreshed by', s.refreshed_by) : null),
  s.last_error ? h('p', { class: 'error-box', 'data-testid': `source-error-${source.id}` },
    h('strong', null, 'Last error: '), s.last_error) : null,
  holding ? h('div', { class: 'guard-box' },
    guardLine(source),
    s.guard.held && s.guard.held.length
      ? h('p', { class: 'small' }, 'Held: ', h('code', null, s.guard.held.slice(0, 12).join(', ')),
        s.guard.held.length > 12 ? ` and ${s.guard.held.length - 12} more` : '') : null) : null,
  admin ? h('div', { class: 'source-actions' },
    h('button', {
      type: 'button', class: 'btn btn-small', 'data-testid': `refresh-source-${source.id}`,
      'data-focus': `refresh-${source.id}`, disabled: state.busy.has(refreshKey),
      'data-action': 'refresh-source', 'data-id': source.id,
    }, state.busy.has(refreshKey) ? 'Refreshing…' : 'Refresh now'),
    holding ? h('button', {
      type: 'button', class: 'btn btn-small btn-warn', 'data-testid': `accept-removals-${source.id}`,
      'data-focus': `accept-${source.id}`, disabled: state.busy.has(acceptKey),
      'data-action': 'accept-removals', 'data-id': source.id,
    }, 'Accept held removals') : null) : null,
  [refreshKey, acceptKey].map((key) => (state.errors.get(key)
    ? h('p', { class: 'action-error', role: 'alert', 'data-testid': `action-error-${key}` },
      state.errors.get(key)) : null)));
}

// ---------------------------------------------------------------------------------------------
// What the page does (delegated from `main`, so re-rendered nodes need no listeners)
// ---------------------------------------------------------------------------------------------

function runAction(action, id) {
  switch (action) {
    case 'toggle-target': {
      const target = state.targets.get(id);
      if (!target) return;
      act(`target-${id}`, 'PATCH', `targets/${id}`, { enabled: !target.enabled }, (updated) => {
        const known = state.targets.get(id);
        if (known && updated) state.targets.set(id, { ...known, ...updated });
      });
      break;
    }
    case 'refresh-source':
      act(`refresh-${id}`, 'POST', `discovery-sources/${id}/refresh`, undefined, (status) => {
        const known = state.sources.get(id);
        if (known && status && status.source_id === id) state.sources.set(id, { ...known, status });
      });
      break;
    case 'accept-removals':
      act(`accept-${id}`, 'POST', `discovery-sources/${id}/accept-removals`);
      break;
    case 'close-history':
      state.openTarget = null;
      scheduleRender();
      break;
    case 'canary-pause':
    case 'canary-resume':
    case 'canary-promote':
    case 'canary-rollback': {
      // Taken on the canary as the gateway has it: one that moved meanwhile may answer 409,
      // whose message shows beside the buttons.
      const verb = action.slice('canary-'.length);
      act(`canary-${id}`, 'POST', `routes/${id}/canary/${verb}`, undefined, (view) => {
        if (view && typeof view === 'object') {
          canaryEntry(id).view = view;
          noteCanaryView(id, view);
        }
      });
      break;
    }
    default:
  }
}

function onMainClick(event) {
  if (!state.session) return;
  const control = event.target.closest('[data-action]');
  if (control) {
    runAction(control.getAttribute('data-action'), Number(control.getAttribute('data-id')));
    return;
  }
  if (event.target.closest('a, button')) return;
  const row = event.target.closest('tr[data-target-id]');
  if (row) toggleHistory(Number(row.getAttribute('data-target-id')));
}

function onMainKeydown(event) {
  const row = event.target;
  if (!state.session || !(row instanceof HTMLTableRowElement) || !row.hasAttribute('data-target-id')) return;
  if (event.key === 'Enter' || event.key === ' ') {
    event.preventDefault();
    toggleHistory(Number(row.getAttribute('data-target-id')));
  }
}

function onMainToggle(event) {
  if (event.target instanceof HTMLDetailsElement && event.target.classList.contains('legend')) {
    state.legendOpen = event.target.open;
  }
}

function kv(label, value) {
  return h('div', null, h('dt', null, label), h('dd', null, value));
}

// ---------------------------------------------------------------------------------------------
// Start
// ---------------------------------------------------------------------------------------------

function tick() {
  const now = Date.now();
  if (state.session) {
    pollRefusingLimits(now);
    pollCanaries(now);
  }
  for (const el of document.querySelectorAll('time[data-rel]')) {
    el.textContent = relativeText(el.getAttribute('datetime'), now);
  }
  for (const el of document.querySelectorAll('[data-retry-at]')) {
    el.textContent = retryText(Number(el.getAttribute('data-retry-at')));
  }
  // An ejection that just ended changes a target's colour; a refresh time that just passed
  // changes how a source's schedule reads.
  if (state.session) {
    const justPassed = (iso) => {
      if (!iso) return false;
      const at = new Date(iso).getTime();
      return at <= now && at > now - 1500;
    };
    if ([...state.targets.values()].some((t) => justPassed(t.ejected_until))
      || [...state.sources.values()].some((s) => justPassed(s.status?.next_refresh_at))) {
      scheduleRender();
    }
  }
}

function start() {
  document.getElementById('sign-out').addEventListener('click', () => signOut('Signed out.'));
  const main = document.getElementById('main');
  main.addEventListener('click', onMainClick);
  main.addEventListener('keydown', onMainKeydown);
  // `toggle` does not bubble: listen while it is captured.
  main.addEventListener('toggle', onMainToggle, true);
  window.addEventListener('hashchange', () => {
    state.openTarget = null;
    state.revealRoute = null;
    syncRoutes();
    render();
    syncPolling();
    const heading = document.querySelector('#main h1');
    if (heading) {
      heading.setAttribute('tabindex', '-1');
      heading.focus({ preventScroll: true });
    }
    window.scrollTo(0, 0);
    // `#/routes/{id}`: that route's row instead of the top (now, or once the list is read).
    if (state.session) {
      state.revealRoute = currentRoute().routeId;
      revealRouteRow();
    }
  });
  document.addEventListener('keydown', (event) => {
    if (event.key === 'Escape' && state.openTarget !== null) {
      state.openTarget = null;
      scheduleRender();
    }
  });
  setInterval(tick, 1000);
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) {
    document.getElementById('main').replaceChildren(loadingView());
    resume(token);
  } else {
    renderSignIn('');
  }
}

start();
