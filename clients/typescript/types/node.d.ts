// The few Node.js APIs this package and its tests use, declared here because the package's
// only devDependency is `typescript` (no @types/node). Used at compile time only: nothing
// here is emitted. The names and shapes follow Node's own documentation (Node >= 18), so the
// emitted .d.ts files refer to the same globals (`AbortSignal`) that @types/node declares.

/* eslint-disable */

declare var process: NodeProcess;
interface NodeProcess {
  readonly pid: number;
  readonly platform: string;
  readonly execPath: string;
  readonly argv: string[];
  readonly version: string;
  readonly versions: Record<string, string | undefined>;
  env: Record<string, string | undefined>;
  exitCode: number | undefined;
  cwd(): string;
  exit(code?: number): never;
  kill(pid: number, signal?: string | number): true;
  nextTick(fn: (...args: any[]) => void, ...args: any[]): void;
  emitWarning(warning: string | Error, type?: string, code?: string): void;
  on(event: string, listener: (...args: any[]) => void): this;
  once(event: string, listener: (...args: any[]) => void): this;
  off(event: string, listener: (...args: any[]) => void): this;
  hrtime: { bigint(): bigint };
  stdout: { write(s: string): boolean };
  stderr: { write(s: string): boolean };
}

interface NodeTimer {
  ref(): this;
  unref(): this;
  hasRef(): boolean;
}
declare function setTimeout(fn: (...args: any[]) => void, ms?: number, ...args: any[]): NodeTimer;
declare function clearTimeout(t: NodeTimer | undefined): void;
declare function setInterval(fn: (...args: any[]) => void, ms?: number, ...args: any[]): NodeTimer;
declare function clearInterval(t: NodeTimer | undefined): void;
declare function setImmediate(fn: (...args: any[]) => void, ...args: any[]): unknown;
declare function queueMicrotask(fn: () => void): void;

declare var performance: { now(): number; timeOrigin: number };

declare var console: {
  log(...args: any[]): void;
  error(...args: any[]): void;
  warn(...args: any[]): void;
  info(...args: any[]): void;
};

interface AbortSignal {
  readonly aborted: boolean;
  readonly reason: any;
  onabort: ((this: AbortSignal, ev: any) => any) | null;
  throwIfAborted(): void;
  addEventListener(type: "abort", listener: (ev: any) => void, options?: { once?: boolean; signal?: AbortSignal }): void;
  removeEventListener(type: "abort", listener: (ev: any) => void): void;
}
declare var AbortSignal: {
  prototype: AbortSignal;
  abort(reason?: any): AbortSignal;
  timeout(ms: number): AbortSignal;
};
interface AbortController {
  readonly signal: AbortSignal;
  abort(reason?: any): void;
}
declare var AbortController: { prototype: AbortController; new (): AbortController };

declare class TextDecoder {
  constructor(label?: string, options?: { fatal?: boolean; ignoreBOM?: boolean });
  decode(input?: Uint8Array, options?: { stream?: boolean }): string;
}
declare class TextEncoder {
  encode(input?: string): Uint8Array;
}

interface Buffer extends Uint8Array {
  toString(encoding?: string): string;
}
declare var Buffer: {
  from(data: string | Uint8Array | ArrayBuffer, encoding?: string): Buffer;
  concat(list: readonly Uint8Array[]): Buffer;
  byteLength(s: string): number;
  isBuffer(x: unknown): x is Buffer;
  alloc(n: number, fill?: number): Buffer;
};

interface ErrnoException extends Error {
  code?: string;
  errno?: number;
  syscall?: string;
  path?: string;
}

interface ImportMeta {
  url: string;
  dirname?: string;
  filename?: string;
}

declare module "node:events" {
  export class EventEmitter {
    on(event: string | symbol, listener: (...args: any[]) => void): this;
    once(event: string | symbol, listener: (...args: any[]) => void): this;
    off(event: string | symbol, listener: (...args: any[]) => void): this;
    emit(event: string | symbol, ...args: any[]): boolean;
    listenerCount(event: string | symbol): number;
    rawListeners(event: string | symbol): Function[];
    removeAllListeners(event?: string | symbol): this;
  }
  export function once(emitter: EventEmitter, event: string, options?: { signal?: AbortSignal }): Promise<any[]>;
}

declare module "node:net" {
  import { EventEmitter } from "node:events";
  export class Socket extends EventEmitter {
    ref(): this;
    unref(): this;
    destroy(error?: Error): this;
    end(): this;
    write(data: string | Uint8Array): boolean;
    setEncoding(enc: string): this;
    readonly destroyed: boolean;
  }
  export function createConnection(path: string): Socket;
  export function createConnection(options: { path?: string; port?: number; host?: string }): Socket;
  export class Server extends EventEmitter {
    listen(port: number, host: string, cb?: () => void): this;
    close(cb?: () => void): this;
    address(): { port: number; address: string } | string | null;
  }
  export function createServer(listener?: (s: Socket) => void): Server;
}

declare module "node:http" {
  import { EventEmitter } from "node:events";
  import { Socket } from "node:net";
  export type OutgoingHttpHeaders = Record<string, string | number | string[] | undefined>;
  export type IncomingHttpHeaders = Record<string, string | string[] | undefined>;
  export interface RequestOptions {
    socketPath?: string;
    host?: string;
    hostname?: string;
    port?: number;
    method?: string;
    path?: string;
    headers?: OutgoingHttpHeaders;
    agent?: false | undefined;
    timeout?: number;
    signal?: AbortSignal;
  }
  export class IncomingMessage extends EventEmitter {
    statusCode?: number;
    statusMessage?: string;
    headers: IncomingHttpHeaders;
    socket: Socket;
    setEncoding(enc: string): this;
    destroy(error?: Error): this;
    resume(): this;
    [Symbol.asyncIterator](): AsyncIterableIterator<Buffer>;
    /** Server side: the request's method and target. */
    method?: string;
    url?: string;
  }
  export class ClientRequest extends EventEmitter {
    setTimeout(ms: number, cb?: () => void): this;
    end(data?: string | Uint8Array, cb?: () => void): this;
    write(data: string | Uint8Array): boolean;
    destroy(error?: Error): this;
    readonly destroyed: boolean;
  }
  export function request(options: RequestOptions, callback?: (res: IncomingMessage) => void): ClientRequest;
  export function get(options: RequestOptions, callback?: (res: IncomingMessage) => void): ClientRequest;
  // Server side, for tests that stand in for mepd (test/contract.test.ts).
  export class ServerResponse extends EventEmitter {
    writeHead(status: number, headers?: OutgoingHttpHeaders): this;
    end(data?: string | Uint8Array, cb?: () => void): this;
  }
  export class Server extends EventEmitter {
    listen(path: string, cb?: () => void): this;
    close(cb?: (err?: Error) => void): this;
  }
  export function createServer(handler: (req: IncomingMessage, res: ServerResponse) => void): Server;
}

declare module "node:async_hooks" {
  export class AsyncLocalStorage<T> {
    getStore(): T | undefined;
    run<R>(store: T, callback: () => R): R;
  }
}

declare module "node:fs" {
  export interface Stats {
    isFile(): boolean;
    isDirectory(): boolean;
    isSocket(): boolean;
    size: number;
  }
  export function readFileSync(path: string): Buffer;
  export function readFileSync(path: string, encoding: string): string;
  export function writeFileSync(path: string, data: string | Uint8Array, options?: { mode?: number } | string): void;
  export function existsSync(path: string): boolean;
  export function statSync(path: string): Stats;
  export function mkdirSync(path: string, options?: { recursive?: boolean; mode?: number }): string | undefined;
  export function mkdtempSync(prefix: string): string;
  export function rmSync(path: string, options?: { recursive?: boolean; force?: boolean }): void;
  export function openSync(path: string, flags: string, mode?: number): number;
  export function closeSync(fd: number): void;
  export function readdirSync(path: string): string[];
}

declare module "node:fs/promises" {
  import { Stats } from "node:fs";
  export function readFile(path: string): Promise<Buffer>;
  export function readFile(path: string, encoding: string): Promise<string>;
  export function writeFile(path: string, data: string | Uint8Array, options?: { mode?: number } | string): Promise<void>;
  export function appendFile(path: string, data: string | Uint8Array): Promise<void>;
  export function mkdir(path: string, options?: { recursive?: boolean; mode?: number }): Promise<string | undefined>;
  export function mkdtemp(prefix: string): Promise<string>;
  export function rm(path: string, options?: { recursive?: boolean; force?: boolean }): Promise<void>;
  export function stat(path: string): Promise<Stats>;
  export function access(path: string): Promise<void>;
}

declare module "node:path" {
  export function resolve(...parts: string[]): string;
  export function join(...parts: string[]): string;
  export function dirname(p: string): string;
  export function basename(p: string): string;
  export function isAbsolute(p: string): boolean;
  export const sep: string;
}

declare module "node:os" {
  export function homedir(): string;
  export function tmpdir(): string;
}

declare module "node:url" {
  export function fileURLToPath(url: string | URL): string;
  export function pathToFileURL(path: string): URL;
}
declare class URL {
  constructor(url: string, base?: string | URL);
  readonly href: string;
  readonly pathname: string;
  readonly hostname: string;
  readonly port: string;
  readonly protocol: string;
}
declare class URLSearchParams {
  constructor(init?: Record<string, string> | string);
  toString(): string;
}

declare module "node:child_process" {
  import { EventEmitter } from "node:events";
  export interface SpawnOptions {
    cwd?: string;
    env?: Record<string, string | undefined>;
    stdio?: any;
    detached?: boolean;
  }
  export interface ChildProcess extends EventEmitter {
    readonly pid?: number;
    readonly exitCode: number | null;
    readonly signalCode: string | null;
    stdout: (EventEmitter & { setEncoding(e: string): void }) | null;
    stderr: (EventEmitter & { setEncoding(e: string): void }) | null;
    kill(signal?: string | number): boolean;
    unref(): void;
  }
  export function spawn(command: string, args: readonly string[], options?: SpawnOptions): ChildProcess;
  export interface SpawnSyncReturns {
    pid: number;
    status: number | null;
    signal: string | null;
    stdout: string;
    stderr: string;
    error?: Error;
  }
  export function spawnSync(
    command: string,
    args: readonly string[],
    options?: SpawnOptions & { encoding?: string; timeout?: number; input?: string },
  ): SpawnSyncReturns;
}

declare module "node:test" {
  export interface TestContext {
    skip(message?: string): void;
    diagnostic(message: string): void;
    after(fn: () => unknown): void;
    readonly name: string;
  }
  export interface TestOptions {
    skip?: boolean | string;
    timeout?: number;
    concurrency?: number | boolean;
  }
  type Fn = (t: TestContext) => unknown;
  export function test(name: string, fn: Fn): Promise<void>;
  export function test(name: string, options: TestOptions, fn: Fn): Promise<void>;
  export function describe(name: string, fn: () => unknown): void;
  export function describe(name: string, options: TestOptions, fn: () => unknown): void;
  export function before(fn: () => unknown, options?: { timeout?: number }): void;
  export function after(fn: () => unknown, options?: { timeout?: number }): void;
  export function beforeEach(fn: () => unknown): void;
  export function afterEach(fn: () => unknown): void;
  export default test;
}

declare module "node:assert/strict" {
  function assert(value: unknown, message?: string): asserts value;
  namespace assert {
    function ok(value: unknown, message?: string): asserts value;
    function equal<T>(actual: unknown, expected: T, message?: string): asserts actual is T;
    function notEqual(actual: unknown, expected: unknown, message?: string): void;
    function deepEqual<T>(actual: unknown, expected: T, message?: string): asserts actual is T;
    function notDeepEqual(actual: unknown, expected: unknown, message?: string): void;
    function match(value: string, re: RegExp, message?: string): void;
    function fail(message?: string): never;
    function throws(fn: () => unknown, expected?: unknown, message?: string): void;
    function doesNotThrow(fn: () => unknown, message?: string): void;
    function rejects(p: Promise<unknown> | (() => Promise<unknown>), expected?: unknown, message?: string): Promise<void>;
    function doesNotReject(p: Promise<unknown> | (() => Promise<unknown>), message?: string): Promise<void>;
  }
  export default assert;
}

declare module "node:timers/promises" {
  export function setTimeout<T = void>(ms?: number, value?: T, options?: { signal?: AbortSignal; ref?: boolean }): Promise<T>;
}
