{{- define "tokengate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tokengate.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "tokengate.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "tokengate.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tokengate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tokengate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tokengate.labels" -}}
{{ include "tokengate.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "tokengate.adminSecret" -}}
{{- .Values.adminToken.existingSecret | default (printf "%s-admin" (include "tokengate.fullname" .)) -}}
{{- end -}}

{{/*
tokengate.config is the configuration file: the values' config with the
listeners on every interface at the chart's ports and the environment
variables the chart sets.
*/}}
{{- define "tokengate.config" -}}
{{- $cfg := deepCopy .Values.config -}}
{{- $listeners := default dict $cfg.listeners -}}
{{- $_ := set $listeners "grpc" (printf "0.0.0.0:%v" .Values.ports.grpc) -}}
{{- $_ := set $listeners "admin" (printf "0.0.0.0:%v" .Values.ports.admin) -}}
{{- if .Values.ports.ratelimitMetrics -}}
{{- $_ := set $listeners "ratelimit_metrics" (printf "0.0.0.0:%v" .Values.ports.ratelimitMetrics) -}}
{{- end -}}
{{- $adminAPI := or .Values.adminToken.existingSecret .Values.adminToken.value -}}
{{- if and .Values.insecure (or (not $listeners.grpc_tls) (and $adminAPI (not $listeners.admin_tls))) -}}
{{- $_ := set $listeners "insecure" true -}}
{{- end -}}
{{- $_ := set $cfg "listeners" $listeners -}}
{{- if or .Values.adminToken.existingSecret .Values.adminToken.value -}}
{{- $_ := set $cfg "admin_api" (merge (default dict $cfg.admin_api) (dict "token_env" "TOKENGATE_ADMIN_TOKEN")) -}}
{{- end -}}
{{- if .Values.redis.passwordSecret -}}
{{- $store := default dict $cfg.store -}}
{{- $_ := set $store "redis" (merge (default dict $store.redis) (dict "password_env" "TOKENGATE_REDIS_PASSWORD")) -}}
{{- $_ := set $cfg "store" $store -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* tokengate.adminScheme: HTTPS when the admin listener serves TLS. */}}
{{- define "tokengate.adminScheme" -}}
{{- if and .Values.config.listeners .Values.config.listeners.admin_tls -}}HTTPS{{- else -}}HTTP{{- end -}}
{{- end -}}

{{/* tokengate.ratelimitMetricsPath: where listeners.ratelimit_metrics serves. */}}
{{- define "tokengate.ratelimitMetricsPath" -}}
{{- if and .Values.config.listeners .Values.config.listeners.ratelimit_metrics_path -}}{{ .Values.config.listeners.ratelimit_metrics_path }}{{- else -}}/metrics{{- end -}}
{{- end -}}
