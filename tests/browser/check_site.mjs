// The documentation site as a reader's browser shows it: a real headless Chromium opens
// every page at a laptop's and a phone's size and reports what reading the HTML misses.
//
//   node check_site.mjs BASE_URL OUTDIR PAGE [PAGE ...]
//
// BASE_URL serves the built site (a loopback address); each PAGE is a path under it
// (index.html, guides/testing.html). Run from a folder where npm installed
// tests/browser/package.json (tests/test_site_browser.py does both). Writes
// OUTDIR/report.json ({checked, problems: [{page, size, reason}], layouts}) and a full-page
// screenshot of each page with a problem, at the size that shows it (SHOTS=all: of
// every page); exits 0 when it could check every page, whatever it found, else 2.
//
// A problem is:
//   - at 1280x900, a code block (pre > code) wider than its box: the reader scrolls it;
//   - at 390x844, a page wider than the phone: the whole page scrolls sideways;
//   - a console error or an uncaught exception;
//   - a request to any host but 127.0.0.1 / localhost (blocked, and reported);
//   - a request that fails or answers 400 or more (a missing asset);
//   - a link to a page of the site that is not there, or to an #anchor no element has.
import chromium from '@sparticuz/chromium';
import puppeteer from 'puppeteer-core';
import { mkdirSync, writeFileSync } from 'node:fs';

const [base, outdir, ...paths] = process.argv.slice(2);
if (!base || !outdir || paths.length === 0) {
  console.error('usage: node check_site.mjs BASE_URL OUTDIR PAGE [PAGE ...]');
  process.exit(2);
}
const SIZES = [
  { name: '1280x900', width: 1280, height: 900, isMobile: false, hasTouch: false },
  { name: '390x844', width: 390, height: 844, isMobile: true, hasTouch: true },
];
const LOCAL = new Set(['127.0.0.1', 'localhost', '[::1]']);
const allShots = process.env.SHOTS === 'all';
const root = new URL(base);
mkdirSync(outdir, { recursive: true });

const problems = [];
const report = (page, size, reason) => problems.push({ page, size, reason });
const idsOf = new Map(); // page path -> the ids of its elements (anchors a link may name)
const linksOf = new Map(); // page path -> [{href, text}] of its <a> elements
const layouts = {}; // page path -> size -> {height, words, guideList}

// Everything the browser would fetch from elsewhere, or start in the background, is off:
// the site must work offline.
const quiet = [
  '--no-sandbox', // root in a container has no user namespaces for the sandbox
  '--disable-background-networking',
  '--disable-component-update',
  '--disable-sync',
  '--no-first-run',
  '--disable-domain-reliability',
  '--no-pings',
];
const browser = await puppeteer.launch({
  args: [...new Set([...chromium.args, ...quiet])],
  executablePath: await chromium.executablePath(),
  headless: true,
  protocolTimeout: 60000,
});
// The browser's process id, for a caller that must be sure nothing is left running.
writeFileSync(`${outdir}/chromium.pid`, String(browser.process()?.pid ?? ''));

let exitCode = 0;
try {
  for (const size of SIZES) {
    const tab = await browser.newPage();
    await tab.setViewport({
      width: size.width,
      height: size.height,
      deviceScaleFactor: 1,
      isMobile: size.isMobile,
      hasTouch: size.hasTouch,
    });
    await tab.setRequestInterception(true);
    let notes = [];
    tab.on('request', (request) => {
      const url = new URL(request.url());
      if (['data:', 'blob:', 'about:'].includes(url.protocol) || LOCAL.has(url.hostname)) {
        request.continue();
        return;
      }
      notes.push(`a request leaves the machine: ${request.url()}`);
      request.abort('blockedbyclient');
    });
    tab.on('requestfailed', (request) => {
      const url = new URL(request.url());
      if (LOCAL.has(url.hostname)) {
        notes.push(`request failed: ${request.url()} (${request.failure()?.errorText})`);
      }
    });
    tab.on('response', (response) => {
      if (response.status() >= 400) {
        notes.push(`HTTP ${response.status()} for ${response.url()}`);
      }
    });
    tab.on('console', (message) => {
      if (message.type() === 'error') {
        const where = message.location()?.url ? ` (${message.location().url})` : '';
        notes.push(`console error: ${message.text()}${where}`);
      }
    });
    tab.on('pageerror', (error) => notes.push(`uncaught exception: ${error.message}`));

    for (const path of paths) {
      notes = [];
      try {
        await tab.goto(new URL(path, root).href, { waitUntil: 'networkidle0', timeout: 30000 });
      } catch (error) {
        notes.push(`did not load within 30 s: ${error.message}`);
      }
      const seen = await tab.evaluate((width) => {
        const blocks = [...document.querySelectorAll('pre > code')];
        const overflowing = blocks
          .filter((code) => code.scrollWidth > code.clientWidth)
          .map((code) => {
            const lines = code.innerText.split('\n');
            const longest = lines.reduce((a, b) => (b.length > a.length ? b : a), '');
            return `${code.scrollWidth} px of code in a ${code.clientWidth} px box: ` +
              `"${longest.trim().slice(0, 90)}" (${longest.length} characters)`;
          });
        const doc = document.documentElement;
        const pageWidth = Math.max(doc.scrollWidth, document.body ? document.body.scrollWidth : 0);
        // what sticks out on the right, so that the failure says what to fix
        const wide = [...document.querySelectorAll('body *')]
          .filter((el) => el.getBoundingClientRect().right > width + 1)
          .filter((el) => !el.parentElement || el.parentElement.getBoundingClientRect().right <= width + 1)
          .slice(0, 3)
          .map((el) => `<${el.tagName.toLowerCase()}${el.className ? ` class="${el.className}"` : ''}>`);
        const ids = [...document.querySelectorAll('[id]')].map((el) => el.id);
        ids.push(...[...document.querySelectorAll('a[name]')].map((el) => el.getAttribute('name')));
        const links = [...document.querySelectorAll('a[href]')].map((a) => ({
          href: a.href,
          raw: a.getAttribute('href'),
          text: a.textContent.trim().slice(0, 40),
        }));
        // how far a reader scrolls: the page's height, its words, and where the first list
        // of links to the guides ends (the front page's table of contents)
        const article = document.querySelector('article') || document.body;
        const list = [...article.querySelectorAll('ul')].find((ul) =>
          ul.querySelector('a[href^="guides/"]'),
        );
        const box = list ? list.getBoundingClientRect() : null;
        const layout = {
          height: doc.scrollHeight,
          words: article.innerText.split(/\s+/).filter(Boolean).length,
          guideList: box ? { top: box.top + window.scrollY, bottom: box.bottom + window.scrollY } : null,
        };
        return { overflowing, pageWidth, wide, ids, links, layout };
      }, size.width);

      layouts[path] = { ...layouts[path], [size.name]: seen.layout };
      const failures = [...notes];
      if (size.name === '1280x900') {
        failures.push(...seen.overflowing.map((o) => `code block scrolls sideways: ${o}`));
        idsOf.set(path, new Set(seen.ids));
        linksOf.set(path, seen.links);
      } else if (seen.pageWidth > size.width) {
        failures.push(
          `the page scrolls sideways: ${seen.pageWidth} px wide on a ${size.width} px screen` +
            (seen.wide.length ? ` (sticking out: ${seen.wide.join(', ')})` : ''),
        );
      }
      for (const reason of failures) report(path, size.name, reason);
      if (failures.length || allShots) {
        const shot = `${outdir}/${size.name}-${path.replace(/[^\w.-]+/g, '_')}.png`;
        await tab.screenshot({ path: shot, fullPage: true }).catch(() => {});
      }
    }
    await tab.close();
  }

  // Links and anchors, once every page's ids are known. A link to another file of the
  // site (an image, objects.inv) is fetched once to see that it is served.
  const served = new Map();
  const isServed = async (url) => {
    if (!served.has(url)) {
      served.set(
        url,
        await fetch(url, { method: 'HEAD' })
          .then((response) => response.ok)
          .catch(() => false),
      );
    }
    return served.get(url);
  };
  for (const [path, links] of linksOf) {
    for (const { href, raw, text } of links) {
      const url = new URL(href);
      if (!['http:', 'https:'].includes(url.protocol) || !LOCAL.has(url.hostname)) continue;
      let target = decodeURIComponent(url.pathname.slice(root.pathname.length));
      if (target === '' || target.endsWith('/')) target += 'index.html';
      const fragment = decodeURIComponent(url.hash.slice(1));
      const what = `link "${text}" (${raw})`;
      if (!idsOf.has(target)) {
        const where = new URL(url.pathname, root).href;
        if (!(await isServed(where))) report(path, '1280x900', `broken ${what}: no ${target}`);
        continue; // a file that is not one of the pages: no anchors to check
      }
      if (fragment && !idsOf.get(target).has(fragment)) {
        report(path, '1280x900', `broken anchor: ${what}: ${target} has no id "${fragment}"`);
      }
    }
  }
} catch (error) {
  console.error(`the check stopped: ${error.stack || error}`);
  exitCode = 2;
} finally {
  await browser.close().catch(() => browser.process()?.kill('SIGKILL'));
}

const checked = { pages: paths.length, sizes: SIZES.map((s) => s.name) };
writeFileSync(`${outdir}/report.json`, JSON.stringify({ checked, problems, layouts }, null, 1));
console.log(
  `checked ${paths.length} pages at ${checked.sizes.join(' and ')}: ` +
    `${problems.length} problem${problems.length === 1 ? '' : 's'}`,
);
for (const { page, size, reason } of problems) console.log(`${page} at ${size}: ${reason}`);
process.exit(exitCode);
