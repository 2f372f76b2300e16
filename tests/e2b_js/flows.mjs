// The unmodified npm e2b SDK (pinned in package.json) drives E2B's flows against `bunshin serve`:
// create, run with streaming and timeouts, files with metadata and gzip, watch, PTY, fork, pause
// and resume, list with paging. E2B_API_URL and E2B_SANDBOX_URL (or E2B_DOMAIN) and E2B_API_KEY
// point it at the server. Prints one JSON line of what it saw; tests/test_e2b_suite.py checks it.
// Every wait has a deadline: a callback resolves it, a timer fails it.
import { CommandExitError, FileType, Sandbox, TimeoutError } from 'e2b'

const out = {}
const made = []
const tag = `js-flows-${process.pid}-${Date.now()}`

// One pending wait at a time: `until(check)` resolves once `check()` holds, tested now and on
// every `poke()` (the SDK's callbacks poke), and rejects after `ms`.
function waiter() {
  let pending = null
  return {
    poke() {
      if (pending?.check()) {
        clearTimeout(pending.timer)
        pending.resolve()
        pending = null
      }
    },
    until(check, ms, what) {
      return new Promise((resolve, reject) => {
        if (check()) return resolve()
        const timer = setTimeout(() => {
          pending = null
          reject(new Error(`no ${what} within ${ms} ms`))
        }, ms)
        pending = { check, resolve, timer }
      })
    },
  }
}

async function create(metadata) {
  const sbx = await Sandbox.create({ timeoutMs: 180_000, metadata: { tag, ...metadata } })
  made.push(sbx.sandboxId)
  return sbx
}

async function commands(sbx) {
  const stdout = []
  const stderr = []
  const r = await sbx.commands.run('for i in 1 2 3; do echo line$i; done; echo oops >&2', {
    onStdout: (d) => stdout.push(d),
    onStderr: (d) => stderr.push(d),
  })
  let exitCode
  try {
    await sbx.commands.run('exit 3')
  } catch (e) {
    exitCode = e instanceof CommandExitError ? e.exitCode : String(e)
  }
  const started = Date.now()
  let timedOut
  try {
    await sbx.commands.run('sleep 60', { timeoutMs: 1_000 })
  } catch (e) {
    timedOut = e instanceof TimeoutError ? 'TimeoutError' : `${e.constructor.name}: ${e.message}`
  }
  const timeoutSeconds = (Date.now() - started) / 1000
  const bg = await sbx.commands.run('sleep 120', { background: true })
  const listed = (await sbx.commands.list()).some((p) => p.pid === bg.pid)
  const killed = await bg.kill()
  return {
    stdout: r.stdout, streamed: stdout.join(''), stderr: stderr.join(''), exitCode, timedOut,
    timeoutWithin10s: timeoutSeconds < 10, backgroundListed: listed, backgroundKilled: killed,
  }
}

async function files(sbx) {
  const written = await sbx.files.write('/tmp/meta.txt', 'with metadata', { metadata: { Owner: 'js', run: '1' } })
  const info = await sbx.files.getInfo('/tmp/meta.txt')
  const listedEntry = (await sbx.files.list('/tmp')).find((e) => e.name === 'meta.txt')
  const renamed = await sbx.files.rename('/tmp/meta.txt', '/tmp/meta2.txt')
  await sbx.files.write('/tmp/meta2.txt', 'overwritten')
  const cleared = await sbx.files.getInfo('/tmp/meta2.txt')
  const big = 'gzip '.repeat(50_000)
  await sbx.files.write('/tmp/big.txt', big, { gzip: true })
  const plain = await sbx.files.read('/tmp/big.txt')
  const gz = await sbx.files.read('/tmp/big.txt', { gzip: true })
  const size = (await sbx.files.getInfo('/tmp/big.txt')).size
  return {
    writtenMetadata: written.metadata, infoMetadata: info.metadata, listedMetadata: listedEntry?.metadata,
    renamedMetadata: renamed.metadata, overwrittenMetadata: cleared.metadata ?? null,
    gzipRoundTrip: plain === big && gz === big, gzipSize: size === big.length,
  }
}

async function watch(sbx) {
  await sbx.files.makeDir('/tmp/watched')
  const events = []
  const w = waiter()
  const handle = await sbx.files.watchDir('/tmp/watched', (e) => {
    events.push(e)
    w.poke()
  }, { includeEntry: true, timeoutMs: 60_000 })
  await sbx.files.write('/tmp/watched/new.txt', 'watched')
  const isWrite = (e) => e.name === 'new.txt' && e.type === 'write'
  await w.until(() => events.some(isWrite), 30_000, 'write event')
  await handle.stop()
  const write = events.find(isWrite)
  return {
    created: events.some((e) => e.name === 'new.txt' && e.type === 'create'),
    entry: write.entry ? { name: write.entry.name, path: write.entry.path, file: write.entry.type === FileType.FILE } : null,
  }
}

async function pty(sbx) {
  let text = ''
  const dec = new TextDecoder()
  const w = waiter()
  const handle = await sbx.pty.create({
    cols: 80, rows: 24, timeoutMs: 60_000,
    onData: (d) => {
      text += dec.decode(d, { stream: true })
      w.poke()
    },
  })
  const enc = new TextEncoder()
  // The shell echoes the line as typed: only its output holds the product and the size.
  await sbx.pty.sendInput(handle.pid, enc.encode('echo pty-$((6*7))\n'))
  await w.until(() => text.includes('pty-42'), 30_000, 'PTY output')
  await sbx.pty.resize(handle.pid, { cols: 100, rows: 30 })
  await sbx.pty.sendInput(handle.pid, enc.encode('stty size; exit\n'))
  await w.until(() => text.includes('30 100'), 30_000, 'the new PTY size')
  const result = await handle.wait()
  return { echoed: true, resized: true, exitCode: result.exitCode }
}

async function fork(sbx) {
  await sbx.files.write('/tmp/fork.txt', 'before fork')
  const bg = await sbx.commands.run('sleep 300', { background: true })
  const forks = await sbx.fork({ count: 2 })
  const seen = []
  for (const [i, f] of forks.entries()) {
    if (f instanceof Error) throw f
    made.push(f.sandboxId)
    await f.files.write('/tmp/fork.txt', `child ${i}`)
    seen.push({
      read: await f.files.read('/tmp/fork.txt'),
      processLives: (await f.commands.list()).some((p) => p.pid === bg.pid),
    })
  }
  const parent = await sbx.files.read('/tmp/fork.txt')
  const killed = []
  for (const f of forks) killed.push(await f.kill())
  await bg.kill()
  return { children: seen, parentUnchanged: parent, childrenKilled: killed }
}

async function pauseResume(sbx) {
  await sbx.files.write('/tmp/paused.txt', 'kept')
  const bg = await sbx.commands.run('sleep 300', { background: true })
  const paused = await sbx.pause()
  const state = (await Sandbox.getInfo(sbx.sandboxId)).state
  const again = await Sandbox.connect(sbx.sandboxId)
  return {
    paused, stateWhilePaused: state, stateAfterConnect: (await Sandbox.getInfo(sbx.sandboxId)).state,
    file: await again.files.read('/tmp/paused.txt'),
    processLives: (await again.commands.list()).some((p) => p.pid === bg.pid),
  }
}

async function listPaging() {
  const ids = []
  for (let i = 0; i < 3; i++) ids.push((await create({ page: tag })).sandboxId)
  const pager = Sandbox.list({ query: { metadata: { page: tag } }, limit: 2 })
  const pages = []
  while (pager.hasNext) pages.push((await pager.nextItems()).map((s) => s.sandboxId))
  const killed = []
  for (const id of ids) killed.push(await Sandbox.kill(id))
  return {
    pageSizes: pages.map((p) => p.length), allListed: [...pages.flat()].sort().join() === [...ids].sort().join(),
    newestFirst: pages.flat().join() === [...ids].reverse().join(), killed,
  }
}

try {
  const sbx = await create({ flow: 'main' })
  out.create = { running: await sbx.isRunning(), metadata: (await sbx.getInfo()).metadata.flow }
  out.commands = await commands(sbx)
  out.files = await files(sbx)
  out.watch = await watch(sbx)
  out.pty = await pty(sbx)
  out.fork = await fork(sbx)
  out.pauseResume = await pauseResume(sbx)
  out.list = await listPaging()
  out.killed = await Sandbox.kill(sbx.sandboxId)
} catch (e) {
  out.error = `${e?.constructor?.name}: ${e?.message}\n${e?.stack}`
  process.exitCode = 1
} finally {
  for (const id of made) await Sandbox.kill(id).catch(() => {})
}
console.log(JSON.stringify(out))
