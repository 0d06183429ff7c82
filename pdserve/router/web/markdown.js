// A small Markdown renderer that builds DOM nodes and never parses model text as HTML:
// every piece of text goes in through textContent or a text node, so "<script>" in an
// answer is shown as those characters. Links become <a> only for absolute http(s) URLs.
//
// Blocks: ``` fenced code (an unclosed fence runs to the end, as while streaming),
// # headings, - * + and 1. lists, > quotes, paragraphs (line breaks kept).
// Inline: `code`, **bold**, *italic*, [text](url), bare http(s) URLs.

const FENCE = /^\s*```\s*([\w+#.-]*)\s*$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const ITEM = /^\s*([-*+]|\d{1,9}[.)])\s+(.*)$/;
const QUOTE = /^\s*>\s?(.*)$/;
const INLINE =
  /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)|\*\*([^*\n]+)\*\*|\*([^*\s][^*\n]*)\*|\[([^\]\n]+)\]\(([^()\s]+)\)|(https?:\/\/[^\s<>()"']+[^\s<>()"'.,;:!?])/g;

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

// The URL when it is an absolute http(s) URL, else null (javascript:, data:, relative...).
export function safeUrl(raw) {
  let u;
  try {
    u = new URL(raw);
  } catch (_) {
    return null;
  }
  return u.protocol === "http:" || u.protocol === "https:" ? u.href : null;
}

function link(text, href) {
  const a = el("a", null, text);
  a.href = href;
  a.target = "_blank";
  a.rel = "noopener noreferrer nofollow";
  return a;
}

export function renderInline(text, parent) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) parent.append(text.slice(last, m.index));
    last = m.index + m[0].length;
    if (m[1]) parent.append(el("code", null, m[2]));
    else if (m[3]) parent.append(el("strong", null, m[3]));
    else if (m[4]) parent.append(el("em", null, m[4]));
    else if (m[5]) {
      const href = safeUrl(m[6]);
      parent.append(href ? link(m[5], href) : m[0]); // an unsafe link stays plain text
    } else if (m[7]) {
      const href = safeUrl(m[7]);
      parent.append(href ? link(m[7], href) : m[7]);
    }
  }
  if (last < text.length) parent.append(text.slice(last));
}

function codeBlock(lines, lang) {
  const pre = el("pre");
  const code = el("code", null, lines.join("\n"));
  if (lang) code.dataset.lang = lang;
  pre.append(code);
  return pre;
}

function paragraph(lines, tag) {
  const p = el(tag);
  renderInline(lines.join("\n"), p);
  return p;
}

// Replaces the children of `container` with `text` rendered.
export function renderMarkdown(text, container) {
  const out = [];
  const lines = text.split("\n");
  let para = [];
  let list = null;
  const flush = () => {
    if (para.length) out.push(paragraph(para, "p"));
    para = [];
    list = null;
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(FENCE);
    if (fence) {
      flush();
      const body = [];
      while (++i < lines.length && !FENCE.test(lines[i])) body.push(lines[i]);
      out.push(codeBlock(body, fence[1]));
      continue;
    }
    const h = line.match(HEADING);
    const item = line.match(ITEM);
    const quote = line.match(QUOTE);
    if (!line.trim()) {
      flush();
    } else if (h) {
      flush();
      out.push(paragraph([h[2]], "h" + Math.min(6, h[1].length + 2)));
    } else if (item) {
      const tag = /\d/.test(item[1]) ? "ol" : "ul";
      if (para.length || !list || list.tagName.toLowerCase() !== tag) {
        flush();
        list = el(tag);
        out.push(list);
      }
      list.append(paragraph([item[2]], "li"));
    } else if (quote) {
      flush();
      out.push(paragraph([quote[1]], "blockquote"));
    } else {
      if (list) list = null;
      para.push(line);
    }
  }
  flush();
  container.replaceChildren(...out);
}
