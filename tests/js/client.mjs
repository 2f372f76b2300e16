// The unmodified npm e2b SDK against `bunshin serve`: commands, files, fork, pause and
// connect, kill. E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY point it at the server.
// Prints one JSON line of what it saw; tests/test_e2b_server_js.py checks it.
import { Sandbox, CommandExitError } from 'e2b'

const out = {}
const sbx = await Sandbox.create({ timeoutMs: 120_000, metadata: { from: 'js' } })
try {
  const r = await sbx.commands.run('echo "Hello from E2B!"; whoami')
  out.stdout = r.stdout
  try {
    await sbx.commands.run('exit 7')
  } catch (e) {
    out.exitError = e instanceof CommandExitError ? e.exitCode : String(e)
  }
  await sbx.files.write('/tmp/js.txt', 'from js')
  out.read = await sbx.files.read('/tmp/js.txt')
  out.listed = (await sbx.files.list('/tmp')).map((e) => e.name).includes('js.txt')
  const forks = await sbx.fork({ count: 2 })
  out.forks = []
  for (const f of forks) {
    if (f instanceof Error) throw f
    out.forks.push((await f.commands.run('cat /tmp/js.txt')).stdout)
    out.forkKilled = await f.kill()
  }
  out.paused = await sbx.pause()
  out.stateWhilePaused = (await Sandbox.getInfo(sbx.sandboxId)).state
  const same = await Sandbox.connect(sbx.sandboxId)
  out.afterConnect = (await same.commands.run('cat /tmp/js.txt')).stdout
  out.killed = await same.kill()
  out.runningAfterKill = await same.isRunning()
  out.killUnknown = await Sandbox.kill(sbx.sandboxId)
} finally {
  await Sandbox.kill(sbx.sandboxId).catch(() => {})
}
console.log(JSON.stringify(out))
