// HTTP/1.1 over mepd's Unix socket with node:http (one connection per request, as the CLI).
import { request as httpRequest, type IncomingMessage, type ClientRequest } from "node:http";
import { DaemonNotRunning, MepError, Unavailable, problemToError } from "./errors.js";
import { parseJson, stringifyJson, type JsonValue } from "./json.js";

/** An answer from mepd. @internal */
export interface RawResponse {
  status: number;
  headers: Record<string, string | string[] | undefined>;
  text: string;
  json: JsonValue | undefined;
}

/** Options of one request. @internal */
export interface RequestOptions {
  /** Give up when mepd sends nothing for this long; 0 (or Infinity): never. */
  timeoutMs: number;
  signal?: AbortSignal | undefined;
}

const NOT_RUNNING = new Set(["ENOENT", "ECONNREFUSED", "ENOTSOCK", "ENOTDIR"]);

function connectError(socketPath: string, e: unknown): MepError {
  const code = (e as { code?: string }).code;
  if (e instanceof MepError) return e;
  if (code && NOT_RUNNING.has(code)) return new DaemonNotRunning(socketPath, e);
  return new Unavailable({
    code: "unavailable",
    status: 0,
    title: "mepd cannot be reached",
    detail: `talking to mepd at ${socketPath} failed: ${(e as Error)?.message ?? String(e)}`,
    cause: e,
  });
}

/**
 * One request to mepd; resolves with any HTTP answer (errors included), rejects with a
 * {@link MepError} only when no answer came (socket missing, timeout, aborted).
 * @internal
 */
export function rawRequest(
  socketPath: string,
  method: string,
  path: string,
  body: unknown,
  opts: RequestOptions,
): Promise<RawResponse> {
  return new Promise<RawResponse>((resolve, reject) => {
    const data = body === undefined ? undefined : stringifyJson(body);
    const headers: Record<string, string | number> = { Host: "mepd", Connection: "close", Accept: "application/json" };
    if (data !== undefined) {
      headers["Content-Type"] = "application/json";
      headers["Content-Length"] = Buffer.byteLength(data);
    }
    let settled = false;
    let req: ClientRequest;
    const onAbort = () => req.destroy(abortError(opts.signal));
    // An abort is the caller's AbortError (or its signal's reason), not a daemon that failed.
    const failure = (e: unknown) => (opts.signal?.aborted ? abortError(opts.signal) : connectError(socketPath, e));
    const done = (f: () => void) => {
      if (settled) return;
      settled = true;
      opts.signal?.removeEventListener("abort", onAbort);
      f();
    };
    if (opts.signal?.aborted) {
      reject(abortError(opts.signal));
      return;
    }
    req = httpRequest({ socketPath, method, path, headers, agent: false }, (res: IncomingMessage) => {
      const chunks: Uint8Array[] = [];
      res.on("data", (c: Uint8Array) => chunks.push(c));
      res.on("error", (e: Error) => done(() => reject(failure(e))));
      res.on("end", () => {
        const text = Buffer.concat(chunks).toString("utf8");
        let json: JsonValue | undefined;
        if (text.length > 0) {
          try {
            json = parseJson(text);
          } catch {
            json = undefined;
          }
        }
        done(() => resolve({ status: res.statusCode ?? 0, headers: res.headers, text, json }));
      });
    });
    // An idle timeout (no byte from mepd for that long); 0: none, for answers that come only
    // once a long transfer is done (sync, fetch).
    if (opts.timeoutMs > 0 && Number.isFinite(opts.timeoutMs))
      req.setTimeout(opts.timeoutMs, () =>
      req.destroy(
        new Unavailable({
          code: "unavailable",
          status: 0,
          title: "mepd did not answer",
          detail: `no answer from mepd at ${socketPath} within ${opts.timeoutMs} ms (${method} ${path})`,
        }),
      ),
    );
    req.on("error", (e: Error) => done(() => reject(failure(e))));
    opts.signal?.addEventListener("abort", onAbort, { once: true });
    req.end(data);
  });
}

function abortError(signal: AbortSignal | undefined): Error {
  const r = signal?.reason;
  if (r instanceof Error) return r;
  const e = new Error("the operation was aborted");
  e.name = "AbortError";
  return e;
}

/**
 * A request whose answer must be `expect` (or one of them); any other answer becomes the
 * typed error of its problem code.
 * @internal
 */
export async function expectJson(
  socketPath: string,
  method: string,
  path: string,
  body: unknown,
  opts: RequestOptions,
  expect: number | number[],
): Promise<RawResponse> {
  const r = await rawRequest(socketPath, method, path, body, opts);
  const ok = Array.isArray(expect) ? expect.includes(r.status) : r.status === expect;
  if (!ok) throw errorFrom(r);
  return r;
}

/** The typed error of a non-success answer. @internal */
export function errorFrom(r: RawResponse): MepError {
  const ra = r.headers["retry-after"];
  return problemToError(r.status, r.json ?? r.text, Array.isArray(ra) ? ra[0] : ra);
}

/**
 * What a `200` to `POST /v1/detach` says beside `released`: the control plane's problem
 * when it did not confirm the release (undefined for `204`, a confirmed release). @internal
 */
export function releaseProblem(r: RawResponse): MepError | undefined {
  if (r.status !== 200 || r.json === null || typeof r.json !== "object" || Array.isArray(r.json)) return undefined;
  const cp = (r.json as Record<string, unknown>)["control_plane"];
  if (cp === null || typeof cp !== "object" || Array.isArray(cp)) return undefined;
  const status = (cp as Record<string, unknown>)["status"];
  return problemToError(typeof status === "number" ? status : 503, cp);
}

/** Callbacks of an NDJSON stream. @internal */
export interface StreamHandlers {
  /** One parsed line (malformed lines are skipped). */
  onObject(o: JsonValue): void;
  /** The stream ended: daemon stopped, connection failed, or close() was called (`error` undefined then). */
  onEnd(error: MepError | undefined): void;
}

/** An open NDJSON stream. @internal */
export interface OpenStream {
  /** Resolves when the daemon answered 200 (the subscription is live); rejects if it could not be opened. */
  ready: Promise<void>;
  /** Closes the connection; onEnd is called once (with undefined). */
  close(): void;
  /** Whether the open connection keeps the process alive. */
  setRef(keepAlive: boolean): void;
}

/**
 * Opens `GET path` as an NDJSON stream. Unless `unref: false`, the connection does not keep
 * the process alive (its socket is unref'd).
 * @internal
 */
export function openNdjson(
  socketPath: string,
  path: string,
  h: StreamHandlers,
  opts: { openTimeoutMs?: number; unref?: boolean } = {},
): OpenStream {
  // The client's timeoutMs (0: none) bounds the wait for the stream's 200.
  const openTimeoutMs = opts.openTimeoutMs ?? 10000;
  let ended = false;
  let closedByUs = false;
  let resolveReady!: () => void;
  let rejectReady!: (e: unknown) => void;
  const ready = new Promise<void>((res, rej) => {
    resolveReady = res;
    rejectReady = rej;
  });
  ready.catch(() => {}); // the caller may not await it
  const end = (e: MepError | undefined) => {
    if (ended) return;
    ended = true;
    if (e) rejectReady(e);
    else rejectReady(new Unavailable({ code: "unavailable", status: 0, detail: "event stream closed before it opened" }));
    h.onEnd(closedByUs ? undefined : (e ?? undefined));
  };
  const req = httpRequest(
    {
      socketPath,
      method: "GET",
      path,
      headers: { Host: "mepd", Connection: "close", Accept: "application/x-ndjson" },
      agent: false,
    },
    (res: IncomingMessage) => {
      if (res.statusCode !== 200) {
        const chunks: Uint8Array[] = [];
        res.on("data", (c: Uint8Array) => chunks.push(c));
        res.on("end", () => {
          const text = Buffer.concat(chunks).toString("utf8");
          let json: JsonValue | undefined;
          try {
            json = parseJson(text);
          } catch {
            json = undefined;
          }
          end(errorFrom({ status: res.statusCode ?? 0, headers: res.headers, text, json }));
        });
        res.on("error", (e: Error) => end(connectError(socketPath, e)));
        return;
      }
      req.setTimeout(0);
      resolveReady();
      const decoder = new TextDecoder("utf-8");
      let buf = "";
      res.on("data", (c: Uint8Array) => {
        buf += decoder.decode(c, { stream: true });
        let nl: number;
        while ((nl = buf.indexOf("\n")) >= 0) {
          const line = buf.slice(0, nl).trim();
          buf = buf.slice(nl + 1);
          if (!line) continue;
          let o: JsonValue;
          try {
            o = parseJson(line);
          } catch {
            continue;
          }
          if (ended) return;
          h.onObject(o);
        }
      });
      res.on("end", () => {
        // A last line the daemon ended without a newline is still an event.
        const line = (buf + decoder.decode()).trim();
        buf = "";
        if (line && !ended) {
          try {
            h.onObject(parseJson(line));
          } catch {
            /* not JSON: dropped, as above */
          }
        }
        end(undefined);
      });
      res.on("close", () => end(undefined));
      res.on("error", (e: Error) => end(connectError(socketPath, e)));
    },
  );
  let keepAlive = opts.unref === false;
  let sock: { ref(): void; unref(): void } | undefined;
  req.on("socket", (s: { ref(): void; unref(): void }) => {
    sock = s;
    if (!keepAlive) s.unref();
  });
  if (openTimeoutMs > 0 && Number.isFinite(openTimeoutMs))
    req.setTimeout(openTimeoutMs, () =>
      req.destroy(new Unavailable({ code: "unavailable", status: 0, detail: `mepd at ${socketPath} did not open ${path} within ${openTimeoutMs} ms` })),
    );
  req.on("error", (e: Error) => end(connectError(socketPath, e)));
  req.end();
  return {
    ready,
    close() {
      if (ended) return;
      closedByUs = true;
      req.destroy();
      end(undefined);
    },
    setRef(k: boolean) {
      keepAlive = k;
      if (sock) {
        if (k) sock.ref();
        else sock.unref();
      }
    },
  };
}
