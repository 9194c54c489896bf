"""The allowlist templates covey ships: exact host names per package ecosystem."""

from dataclasses import dataclass


@dataclass(frozen=True)
class ShippedTemplate:
    """One template as covey ships it."""

    slug: str
    name: str
    description: str  # one or two sentences: what it covers and what tools use it
    entries: tuple[str, ...]  # "host" (port 443) or "host:port"
    docs: str  # URL of the package manager's docs page that names these hosts


SHIPPED: tuple[ShippedTemplate, ...] = (
    ShippedTemplate(
        slug="github",
        name="GitHub",
        description=(
            "git clone/fetch/push over HTTPS, the REST and GraphQL API (gh CLI), archive "
            "downloads, raw files, release assets and Git LFS objects on github.com. "
            "Release downloads and LFS objects redirect to the githubusercontent.com hosts listed."
        ),
        entries=(
            "github.com",
            "api.github.com",
            "codeload.github.com",
            "raw.githubusercontent.com",
            "release-assets.githubusercontent.com",
            "objects.githubusercontent.com",
            "lfs.github.com",
            "github-cloud.githubusercontent.com",
            "media.githubusercontent.com",
        ),
        docs=(
            "https://docs.github.com/en/get-started/using-github/"
            "allowing-access-to-githubs-services-from-a-restricted-network"
        ),
    ),
    ShippedTemplate(
        slug="npm",
        name="npm / Yarn / pnpm",
        description=(
            "The public npm registry (metadata and tarballs) used by npm, pnpm, Bun and Corepack, "
            "the Yarn registry mirror and Yarn Berry releases, and nodejs.org for the headers "
            "node-gyp downloads when building native modules."
        ),
        entries=(
            "registry.npmjs.org",
            "registry.yarnpkg.com",
            "repo.yarnpkg.com",
            "nodejs.org",
        ),
        docs="https://docs.npmjs.com/cli/v10/using-npm/registry",
    ),
    ShippedTemplate(
        slug="pypi",
        name="PyPI",
        description=(
            "The Python Package Index for pip, uv, Poetry and pipx: the simple/JSON index on "
            "pypi.org and the wheel and sdist files on files.pythonhosted.org. "
            "pypi.python.org is the legacy index name older configurations still use."
        ),
        entries=(
            "pypi.org",
            "files.pythonhosted.org",
            "pypi.python.org",
        ),
        docs="https://docs.pypi.org/api/index-api/",
    ),
    ShippedTemplate(
        slug="go",
        name="Go modules",
        description=(
            "The Go module proxy and checksum database the go command uses by default; module "
            "zips redirect to storage.googleapis.com (a shared Google Cloud Storage host). "
            "Also golang.org/go.googlesource.com for direct golang.org/x fetches and "
            "go.dev/dl.google.com for Go toolchain downloads."
        ),
        entries=(
            "proxy.golang.org",
            "sum.golang.org",
            "storage.googleapis.com",
            "golang.org",
            "go.googlesource.com",
            "go.dev",
            "dl.google.com",
        ),
        docs="https://go.dev/ref/mod#module-proxy",
    ),
    ShippedTemplate(
        slug="rust",
        name="Rust / crates.io",
        description=(
            "cargo's sparse index (index.crates.io), crate downloads (static.crates.io) and the "
            "crates.io API, plus rustup's installer and toolchain downloads."
        ),
        entries=(
            "index.crates.io",
            "static.crates.io",
            "crates.io",
            "static.rust-lang.org",
            "sh.rustup.rs",
        ),
        docs="https://doc.rust-lang.org/cargo/reference/registry-index.html",
    ),
    ShippedTemplate(
        slug="composer",
        name="PHP Composer / Packagist",
        description=(
            "Composer's Packagist metadata (repo.packagist.org, packagist.org) and "
            "getcomposer.org for the installer and self-update. Most Packagist packages are "
            "downloaded as GitHub zipballs, which go through api.github.com and "
            "codeload.github.com."
        ),
        entries=(
            "repo.packagist.org",
            "packagist.org",
            "getcomposer.org",
            "api.github.com",
            "codeload.github.com",
        ),
        docs="https://getcomposer.org/doc/05-repositories.md#packagist-org",
    ),
    ShippedTemplate(
        slug="maven-gradle",
        name="Maven / Gradle",
        description=(
            "Maven Central, the Gradle Plugin Portal (which redirects artifacts to "
            "plugins-artifacts.gradle.org), Google's Maven repository for Android, and the "
            "Gradle wrapper's distribution download, which redirects from services.gradle.org "
            "to GitHub release assets."
        ),
        entries=(
            "repo.maven.apache.org",
            "repo1.maven.org",
            "plugins.gradle.org",
            "plugins-artifacts.gradle.org",
            "services.gradle.org",
            "downloads.gradle.org",
            "github.com",
            "release-assets.githubusercontent.com",
            "objects.githubusercontent.com",
            "dl.google.com",
            "maven.google.com",
        ),
        docs="https://docs.gradle.org/current/userguide/declaring_repositories_basics.html",
    ),
    ShippedTemplate(
        slug="container",
        name="Container registries",
        description=(
            "Image pulls from Docker Hub, GitHub Container Registry and Quay, including the "
            "auth service and the CDN/blob hosts their layer downloads redirect to. "
            "registry.k8s.io, gcr.io/pkg.dev, mcr.microsoft.com and public.ecr.aws redirect to "
            "region-specific hosts that cannot be listed exactly, so they are not included."
        ),
        entries=(
            "registry-1.docker.io",
            "auth.docker.io",
            "index.docker.io",
            "production.cloudflare.docker.com",
            "production.cloudfront.docker.com",
            "docker-images-prod.6aa30f8b08e16409b46e0173d6de2f56.r2.cloudflarestorage.com",
            "ghcr.io",
            "pkg-containers.githubusercontent.com",
            "quay.io",
            "cdn.quay.io",
            "cdn01.quay.io",
            "cdn02.quay.io",
            "cdn03.quay.io",
        ),
        docs="https://docs.docker.com/desktop/setup/allow-list/",
    ),
    ShippedTemplate(
        slug="debian-ubuntu",
        name="Debian / Ubuntu apt",
        description=(
            "apt package and security archives for Debian and Ubuntu (including ports.ubuntu.com "
            "for arm64). The stock sources use plain HTTP, so the :80 forms are required; "
            "the Debian hosts also serve HTTPS for https:// sources."
        ),
        entries=(
            "deb.debian.org:80",
            "deb.debian.org",
            "security.debian.org:80",
            "security.debian.org",
            "archive.ubuntu.com:80",
            "security.ubuntu.com:80",
            "ports.ubuntu.com:80",
        ),
        docs="https://wiki.debian.org/SourcesList",
    ),
    ShippedTemplate(
        slug="rubygems",
        name="RubyGems / Bundler",
        description=(
            "rubygems.org for gem downloads and the gem CLI, and the compact index "
            "(index.rubygems.org) that Bundler resolves against."
        ),
        entries=(
            "rubygems.org",
            "index.rubygems.org",
            "api.rubygems.org",
        ),
        docs="https://guides.rubygems.org/rubygems-org-compact-index-api/",
    ),
    ShippedTemplate(
        slug="nuget-dotnet",
        name="NuGet / .NET",
        description=(
            "NuGet restore from nuget.org (v3 API on api.nuget.org, v2 package downloads that "
            "redirect to globalcdn.nuget.org, search endpoints), nuget.exe from dist.nuget.org, "
            "and the .NET SDK install script and downloads."
        ),
        entries=(
            "api.nuget.org",
            "globalcdn.nuget.org",
            "www.nuget.org",
            "nuget.org",
            "azuresearch-usnc.nuget.org",
            "azuresearch-ussc.nuget.org",
            "dist.nuget.org",
            "dot.net",
            "builds.dotnet.microsoft.com",
            "ci.dot.net",
        ),
        docs="https://learn.microsoft.com/en-us/nuget/api/overview",
    ),
    ShippedTemplate(
        slug="alpine-rpm",
        name="Alpine apk / RPM (dnf, yum)",
        description=(
            "apk's Alpine CDN, and the dnf/yum mirror-list and primary hosts for Fedora, "
            "Rocky Linux, CentOS Stream, AlmaLinux and Red Hat UBI. The mirror lists can hand "
            "out third-party mirrors, so pin baseurl to the primary hosts listed here."
        ),
        entries=(
            "dl-cdn.alpinelinux.org",
            "dl-cdn.alpinelinux.org:80",
            "mirrors.fedoraproject.org",
            "dl.fedoraproject.org",
            "download.fedoraproject.org",
            "mirrors.rockylinux.org",
            "dl.rockylinux.org",
            "dl.rockylinux.org:80",
            "mirrors.centos.org",
            "mirror.stream.centos.org",
            "mirrors.almalinux.org",
            "repo.almalinux.org",
            "cdn-ubi.redhat.com",
        ),
        docs="https://wiki.alpinelinux.org/wiki/Repositories",
    ),
    ShippedTemplate(
        slug="llm-apis",
        name="LLM APIs",
        description=(
            "API endpoints of the main hosted LLM vendors (Anthropic, OpenAI, Google Gemini, "
            "Mistral, Cohere, Groq, Together, DeepSeek, xAI, OpenRouter, Fireworks, Perplexity) "
            "that coding agents and SDKs call directly."
        ),
        entries=(
            "api.anthropic.com",
            "api.openai.com",
            "generativelanguage.googleapis.com",
            "api.mistral.ai",
            "codestral.mistral.ai",
            "api.cohere.com",
            "api.groq.com",
            "api.together.xyz",
            "api.deepseek.com",
            "api.x.ai",
            "openrouter.ai",
            "api.fireworks.ai",
            "api.perplexity.ai",
        ),
        docs="https://docs.claude.com/en/api/overview",
    ),
)
